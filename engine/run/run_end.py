"""The end of a run: record its outcome in the run folder, tell the callbacks, close the run's parts.

Called once, whatever the outcome (finished, stopped, failed, aborted), by ``Trainer._finish``. The
outcome is returned (and printed) even when the run folder cannot record it.

Also the set-up's beginning and its end when it does not reach the loop: the folder exists, "starting"
with its phase, before any of the task's code runs (``setup_begins``); a stop there ends the run
"stopped", a second Ctrl+C "aborted", a crash "failed" with its traceback and one line (exit 2), a
refusal (bad input found in set-up) leaves no folder of a new run and a resumed one as it was found
(``setup_ended``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
import traceback
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from multilane.engine.errors import UserError, one_line, where
from multilane.engine.run.callbacks import RunResult
from multilane.engine.run.control import SetupStopped
from multilane.engine.rundir.runlog import STATUS, RunDir
from multilane.engine.rundir.writefile import atomic_write_bytes

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
    for part in ("strategy", "loader", "backend"):  # the parts the run got as far as building
        if hasattr(trainer, part):
            getattr(trainer, part).close()
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


def setup_begins(trainer: Trainer, rd: RunDir, record: Callable[[], None]) -> tuple[str, Any]:
    """Before the set-up: the folder says "starting" (a new or given folder also holds what the run
    trains). Returns how the folder came (``new``, ``given``, ``resumed``) and a resumed one's status as
    found, for ``setup_ended``."""
    kind = "resumed" if trainer._resume_dir is not None else "given" if trainer._made_run_dir else "new"
    found = None
    if kind == "resumed":  # its status.json as found: bytes and times
        with contextlib.suppress(OSError):
            st = os.stat(rd.path / STATUS)
            found = ((rd.path / STATUS).read_bytes(), st.st_atime_ns, st.st_mtime_ns)
    else:
        record()
    trainer._phase("starting")
    return kind, found


def setup_ended(trainer: Trainer, e: BaseException, begun: tuple[str, Any]) -> RunResult:
    """The set-up ended by ``e`` before the loop: the result of a stop, or ``UserError`` raised (one line)."""
    kind, found = begun
    rd = trainer.run_dir
    assert rd is not None
    phase = getattr(trainer, "phase", "starting")
    kept = (
        f"the checkpoint of step {trainer.checkpoint_step} is as it was"
        if trainer.checkpoint_step is not None
        else "nothing was trained, no checkpoint"
    )
    if isinstance(e, SetupStopped):
        why = f" ({e.args[0]})" if e.args and e.args[0] else ""
        return finish_run(
            trainer, "stopped", f"stopped while {phase}, before step {trainer.step + 1}{why}; {kept}", None
        )
    if isinstance(e, KeyboardInterrupt):
        return finish_run(trainer, "aborted", f"aborted while {phase} (a second Ctrl+C or SIGTERM); {kept}", None)
    refused = isinstance(e, UserError)
    line = str(e) if refused else f"task {trainer.task.name}: setup failed{where(e)}: {one_line(e)}"
    _close_parts(trainer)
    if kind == "resumed" and (refused or found is not None):  # no step was taken: the folder as found
        with contextlib.suppress(OSError):
            if found is not None:
                atomic_write_bytes(rd.path / STATUS, found[0])
                os.utime(rd.path / STATUS, ns=found[1:])
        trainer.run_dir = None  # Trainer.run closes it as refused: its lock file as found too
    elif refused:  # bad input found in set-up: a new folder goes, as a refusal leaves none; one made by
        rd.close()  # whoever started the run is left as they made it (their one line says why: the app's
        trainer.run_dir = None  # "Not started", a sweep's failed trial)
        if kind == "new":
            shutil.rmtree(rd.path, ignore_errors=True)
            if getattr(rd, "made_root", False):  # the runs folder too, when this run made it (and it is empty)
                with contextlib.suppress(OSError):
                    rd.path.parent.rmdir()
        else:
            rd.remove(STATUS)
    else:  # the task's code failed: the folder says so, as for any crash
        with contextlib.suppress(OSError):
            rd.write_error("".join(traceback.format_exception(type(e), e, e.__traceback__)))
            rd.set_status("failed", line, step=trainer.step, phase=phase)
        rd.close()
    raise UserError(line) from None


@contextlib.contextmanager
def fit_check_phases(trainer: Trainer) -> Iterator[None]:
    """The fit check's phases in the folder's status: it loads the task's data and builds its model too
    (the probe), the task's own code, which may take long or never return."""
    task = trainer.task
    originals = {name: getattr(task, name) for name in ("data", "build_model")}
    words = {"data": "checking the fit: loading data", "build_model": "checking the fit: building the model"}

    def phased(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            trainer._phase(words[name])
            return originals[name](*args, **kwargs)

        return call

    trainer._phase("checking the fit")
    for name in originals:
        setattr(task, name, phased(name))
    try:
        yield
    finally:
        for name in originals:
            with contextlib.suppress(AttributeError):
                delattr(task, name)  # the class's own methods again (nothing of the trainer kept in the task)


def _close_parts(trainer: Trainer) -> None:
    for part in ("strategy", "loader", "backend"):
        if hasattr(trainer, part):
            with contextlib.suppress(Exception):
                getattr(trainer, part).close()


def training_begins(trainer: Trainer, rd: Any, resumed: bool) -> None:
    """The set-up done: the sampler and energy meter on, the folder "running", the callbacks told, and the
    ``started`` event (with the device list, in the run's order: the app colours each device from it
    before any record) and the run's warnings written."""
    from multilane.engine.run.balance import balance_warnings
    from multilane.engine.run.energy import EnergyMeter

    trainer.sampler = trainer._make_sampler()
    trainer.energy = EnergyMeter(trainer.sampler)
    rd.set_status("running", step=trainer.step, total_steps=trainer.total_steps)
    for cb in trainer.callbacks:
        cb.on_train_start(trainer)
    extra = {"resumed_from_step": trainer.step} if resumed else {}
    extra["lanes"] = trainer.lane_names
    trainer._event("started", total_steps=trainer.total_steps, **extra)
    for message in [*balance_warnings(trainer.devices), *getattr(trainer.task, "warnings", ())]:
        trainer._event("warning", message=message)
    if trainer.sampler is not None:
        trainer.sampler.start()
