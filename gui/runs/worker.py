"""The engine in a QThread: a worker QObject that only emits plain data and never touches a widget.

Pause and stop are called directly from the GUI thread and only set the engine's thread-safe flags
(a queued slot on a busy worker would run after training ends).
"""

from __future__ import annotations

import gc
from typing import Any

from multilane.engine.config import RunConfig
from multilane.engine.errors import UserError
from multilane.engine.run.control import RunControl
from multilane.engine.run.trainer import RunResult, Trainer, TrainerCallback
from multilane.engine.tasks.loader import TaskFileChanged
from PySide6.QtCore import QObject, Qt, QThread, Signal, Slot


class _Emitter(TrainerCallback):
    def __init__(self, worker: TrainWorker) -> None:
        self.w = worker

    def on_train_start(self, trainer: Trainer) -> None:
        # Set-up is over: what it made (imports, data, model) is long-lived; exempt it from the
        # collector's full passes too, and let the collector run again (see TrainWorker.run).
        gc.freeze()
        gc.enable()
        self.w.started.emit(
            {
                "run_dir": str(trainer.run_dir.path) if trainer.run_dir else "",
                "total_steps": trainer.total_steps,
                "step": trainer.step,
                "devices": list(trainer.lane_names),
                "task": trainer.task.name,
                "steps_per_epoch": (trainer.loader.per_epoch or 0) / trainer.config.train.grad_accum,
            }
        )

    def on_log(self, record: dict[str, Any]) -> None:
        self.w.record.emit(record)

    on_eval = on_log
    on_event = on_log
    on_telemetry = on_log


class TrainWorker(QObject):
    """Runs one training run; create it, move it to a QThread, connect ``thread.started`` to ``run``."""

    # `object`, not `dict`: records are handed over as they are, with no conversion by shiboken (which,
    # with PySide6 6.12 and dicts holding None, crashed the app with "deallocating None").
    started = Signal(object)  # run_dir, total_steps, step, devices
    record = Signal(object)  # every metrics.jsonl record (train, eval, event, telemetry)
    finished = Signal(object)  # status, step, run_dir, message, traceback
    rejected = Signal(str)  # bad input found before the run began: one line

    def __init__(
        self, config: RunConfig | None, resume_from: str | None = None, overrides: dict[str, Any] | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.resume_from = resume_from
        self.overrides = overrides  # a resume's changes to the saved config (the task file, once the user agreed)
        self.control = RunControl()

    @Slot()
    def run(self) -> None:
        # A run's set-up (imports of the task's libraries, the data, the model) makes a few hundred
        # thousand objects, most of them for good; the collector's full passes over them took 40-120 ms
        # each, three times per set-up, holding the GIL (the window stalled). Off until training starts.
        gc.disable()
        try:
            self._run()
        finally:
            gc.enable()

    def _run(self) -> None:
        try:
            trainer = Trainer(
                self.config,
                callbacks=[_Emitter(self)],
                control=self.control,
                resume_from=self.resume_from,
                overrides=self.overrides,
            )
            result = trainer.run()
        except UserError as e:
            self.rejected.emit(str(e))
            rejected = {"status": "rejected", "message": str(e), "step": 0, "run_dir": "", "traceback": None}
            if isinstance(e, TaskFileChanged):  # the window asks whether to run the file as it is now
                rejected["task_file_changed"] = e.path
            self.finished.emit(rejected)
            return
        except Exception as e:
            import traceback

            tb = traceback.format_exc()
            self.finished.emit(
                {"status": "failed", "message": f"{type(e).__name__}: {e}", "step": 0, "run_dir": "", "traceback": tb}
            )
            return
        self.finished.emit(_result_dict(result))

    # Called from the GUI thread: they only set flags.
    def pause(self) -> None:
        self.control.pause()

    def resume(self) -> None:
        self.control.resume()

    def stop(self) -> None:
        self.control.request_stop()


def _result_dict(r: RunResult) -> dict[str, Any]:
    return {
        "status": r.status,
        "step": r.step,
        "run_dir": str(r.run_dir),
        "message": r.message,
        "traceback": r.traceback,
    }


class RunHandle:
    """A worker, its thread and the wiring between them (Qt's own pattern for a background job).

    The worker is a ``TrainWorker`` (the engine in this thread) or a ``follow.FollowWorker`` (a run
    in another process: the app's child, or a folder someone else writes): the window treats both
    alike."""

    def __init__(self, worker: QObject) -> None:
        self.worker = worker
        self.control = worker.control  # the run's flags, for the window (pause, stop, hold)
        self.thread = QThread()
        self.thread.setObjectName("multilane-train")
        worker.moveToThread(self.thread)
        self.thread.started.connect(worker.run)
        # Direct: quit() is thread-safe, and a queued call would wait for the GUI thread, which may
        # itself be waiting for this thread (closing the window mid-run).
        worker.finished.connect(self.thread.quit, Qt.DirectConnection)
        # No `thread.finished -> worker.deleteLater` (Qt's usual recipe): that destroys the worker in the
        # finishing thread, where ~QObject holds one of Qt's pooled signal-slot mutexes while PySide asks
        # for the GIL (to look up a Python disconnectNotify override). A GUI thread that holds the GIL
        # and connects or disconnects anything hashed to the same mutex (setHtml on a label does) then
        # deadlocks with it: the intermittent hang of the GUI tests. The worker is a plain Python-owned
        # QObject: it is deleted, in the GUI thread, when this handle goes.

    @property
    def child(self) -> Any:
        """The app's own training process (``child_run.ChildRun``), or None."""
        return getattr(self.worker, "child", None)

    @property
    def followed(self) -> bool:
        """A run folder another process writes, not started by this app."""
        return hasattr(self.worker, "detach") and self.child is None

    def start(self) -> None:
        self.thread.start()

    def stop_and_wait(self, timeout_ms: int = 60_000) -> bool:
        """Ask the run to stop (it finishes its step and checkpoints), then wait for it to end. A child
        that has not ended by then gets a SIGTERM (the same stop, also when its control file goes
        unread) and 15 s more."""
        self.worker.stop()
        if self.thread.wait(timeout_ms):
            return True
        if self.child is None:
            return False
        self.child.terminate()
        return self.thread.wait(15_000)

    def detach(self, timeout_ms: int = 5_000) -> bool:
        """Stop following a run in another process; the run goes on."""
        self.worker.detach()
        return self.thread.wait(timeout_ms)
