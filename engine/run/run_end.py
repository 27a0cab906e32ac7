"""The end of a run: record its outcome in the run folder, tell the callbacks, close the run's parts.

Called once, whatever the outcome (finished, stopped, failed, aborted), by ``Trainer._finish``. The
outcome is returned (and printed) even when the run folder cannot record it.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any

from multilane.engine.run.callbacks import RunResult

if TYPE_CHECKING:
    from multilane.engine.run.trainer import Trainer


def finish_run(trainer: Trainer, status: str, message: str | None, tb: str | None) -> RunResult:
    """Record ``status`` (with ``message`` and traceback ``tb``) and close the run; the run's result."""
    rd = trainer.run_dir
    assert rd is not None
    if getattr(trainer, "sampler", None) is not None:
        with contextlib.suppress(Exception):
            trainer.sampler.stop()
    elapsed = time.time() - trainer.t_start
    if status != "finished":
        rd.free_reserve()  # room to record the failure, on a disk that filled up
    try:
        if tb:
            rd.write_error(tb)
        rd.set_status(status, message, step=trainer.step, total_steps=getattr(trainer, "total_steps", None))
    except OSError as e:  # the run's outcome is still returned (and printed) as it was
        message = f"{message or status} (the run folder could not record it: {e.strerror or e})"
    memory = trainer.memory.report() if getattr(trainer, "memory", None) is not None else None
    if memory:  # the forecast beside the measured peak (engine/plan/meter.py)
        with contextlib.suppress(Exception):
            trainer._event("memory", peaks=memory)
    extra: dict[str, Any] = {"message": message} if message else {}
    if tb:
        extra["traceback"] = tb
    with contextlib.suppress(Exception):  # reporting must not hide the run's own outcome
        trainer._event(status, **extra)
    rd.close()
    if hasattr(trainer, "strategy"):
        trainer.strategy.close()
    if hasattr(trainer, "loader"):
        trainer.loader.close()
    if hasattr(trainer, "backend"):
        trainer.backend.close()
    result = RunResult(
        status=status,
        step=trainer.step,
        run_dir=rd.path,
        message=message,
        traceback=tb,
        last_train=trainer._last_train,
        last_eval=trainer._last_eval,
        elapsed_s=elapsed,
        memory=memory,
    )
    for cb in trainer.callbacks:
        with contextlib.suppress(Exception):
            cb.on_train_end(result)
    return result
