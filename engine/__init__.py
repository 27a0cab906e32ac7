"""Multilane's training engine: data-parallel training on torch.nn.parallel, with no Qt anywhere.

The engine runs headless (``multilane train``) and the desktop app is one client of it. Its rooms:
``run`` (the loop and its parts), ``data`` (the input pipeline), ``tasks`` (what is trained),
``parallel`` (the device layer), ``distributed`` (ddp), ``rundir`` (the run folder on disk),
``telemetry`` (what the devices do), ``cli`` (the ``multilane`` command). The names most users need
are offered here, imported on first use: ``from multilane.engine import Trainer, RunConfig, Task``.
"""

from multilane.engine.exports import lazy_exports

__version__ = "0.1.0"

__getattr__, _public = lazy_exports(
    __name__,
    {
        "ArrayData": "tasks",
        "RunConfig": "config",
        "RunDir": "rundir",
        "Task": "tasks",
        "Trainer": "run",
        "TrainerCallback": "run",
        "UserError": "errors",
        "build_config": "config",
        "load_config": "config",
        "make_task": "tasks",
        "read_metrics": "rundir",
    },
)
__all__ = ["__version__", *_public]
