"""Runs the window shows while another process trains: a run the app started as a child process
(``gui/runs/child_run.py``: any strategy, ddp always) and a run folder someone else writes (File > Follow run).

Both are one mechanism. A ``FollowWorker`` runs in the window's worker thread, like the in-process
``TrainWorker``, and emits the same ``started``/``record``/``finished`` signals, so the window shows a
followed run exactly like a local one. Its loop polls the run folder with the engine's
``RunFollower`` (incremental: only the bytes appended to metrics.jsonl since the last poll are read)
and, between polls, waits on the child process, so a child that dies is seen at once. Pause, Resume and
Stop write the run folder's control file, which the trainer (every rank of a ddp run) polls between
steps, so they work for a run on another machine too. The training process shares no GIL with the
window: a redraw never delays a step (docs/performance.md).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from multilane.engine.config import RunConfig
from multilane.engine.errors import UserError
from multilane.engine.rundir.control_file import write_control
from multilane.engine.rundir.follow import RunFollower
from multilane.engine.rundir.runlog import CONFIG, ERROR, RunDir
from multilane.gui.runs.child_run import ChildRun, last_logged_step
from PySide6.QtCore import QObject, Signal, Slot

POLL_S = 0.25


class NoHold:
    """A followed run trains in another process: the window's redraw hold does not apply."""

    held_s = 0.0

    def hold(self, max_s: float) -> None: ...
    def release(self) -> None: ...
    def request_stop(self) -> None: ...

    def wait_until_held(self, timeout: float) -> bool:
        return True


class FollowWorker(QObject):
    """Follows one run folder (and supervises its child process, if the app started one)."""

    started = Signal(object)
    record = Signal(object)
    finished = Signal(object)

    def __init__(self, run_dir: str | Path, child: ChildRun | None = None, follower: RunFollower | None = None) -> None:
        super().__init__()
        self.run_dir = Path(run_dir)
        self.child = child
        self.control = NoHold()
        # the app's own child is watched as a process (its outcome says how it ended), not by its lock
        self.follower = follower or RunFollower(self.run_dir, check_writer=child is None)
        self._step = 0
        self._total: int | None = None
        self._lock = threading.Lock()
        self._training = False  # the run's "started" event was seen: its control file is read
        self._pending: str | None = None  # a command given before that, written once it is
        self._detach = threading.Event()

    @property
    def detached(self) -> bool:
        return self._detach.is_set()

    @Slot()
    def run(self) -> None:
        self.started.emit(self._info())
        try:
            result = self._loop()
        except Exception as e:  # an unreadable folder: the window must still learn the follow ended
            result = {"status": "failed", "message": f"following {self.run_dir}: {e}", "step": self._step}
        self.finished.emit({"run_dir": str(self.run_dir), "traceback": None, **result})

    def _loop(self) -> dict[str, Any]:
        while True:
            self._poll()
            if self.follower.done:
                return self._final(self.follower.status or {})
            if self.child is not None and self.child.poll() is not None:
                self._poll()  # what the child wrote before it ended
                if self.follower.done:
                    return self._final(self.follower.status or {})
                return self.child.outcome(max(self._step, last_logged_step(self.run_dir)))
            if self._detach.is_set():
                return {"status": "detached", "message": "no longer followed", "step": self._step}
            if self.child is not None:
                self.child.wait(POLL_S)
            else:
                self._detach.wait(POLL_S)

    def _info(self) -> dict[str, Any]:
        cfg = RunDir(self.run_dir).read_json(CONFIG) or {}
        use = (cfg.get("devices") or {}).get("use")
        devices = [s.strip() for s in use.split(",")] if isinstance(use, str) else []
        task = (cfg.get("task") or {}).get("name")
        info = {"run_dir": str(self.run_dir), "total_steps": self._total, "step": self._step, "devices": devices}
        return info | ({"task": Path(task).name} if isinstance(task, str) and task else {})

    def _poll(self) -> None:
        update = self.follower.poll()
        for rec in update.records:
            kind = rec.get("kind")
            if kind == "train":
                self._step = rec.get("step", self._step)
            elif kind == "event" and rec.get("event") == "started":
                self._began()
            self.record.emit(rec)
        status = update.status
        if status is not None and status.get("total_steps") and self._total is None:
            self._total = status["total_steps"]  # now the window can show progress and an ETA
            self.started.emit(self._info())

    def _began(self) -> None:
        with self._lock:
            self._training, pending, self._pending = True, self._pending, None
        if pending is not None:
            self._write(pending)

    def _final(self, status: dict[str, Any]) -> dict[str, Any]:
        if self.follower.problem:  # a FIFO or a folder where a file belongs: never opened, never waited on
            message = f"cannot follow it: {self.follower.problem}"
            return {"status": "detached", "step": self._step, "message": message, "traceback": None}
        if self.follower.lost:  # a followed run whose writer died: said, never written into its folder
            return {"status": "failed", "step": self._step, "message": self.follower.lost, "traceback": None}
        if self.child is not None:
            self.child.wait(10)  # the status is written; the process is closing its files
        state = status.get("state", "finished")
        tb = None
        if state == "failed":
            try:
                tb = (self.run_dir / ERROR).read_text(encoding="utf-8", errors="replace") or None
            except OSError:
                pass
        return {
            "status": state,
            "step": status.get("step") or self._step,
            "message": status.get("message"),
            "traceback": tb,
        }

    # -- called from the GUI thread ----------------------------------------------------------------
    def pause(self) -> None:
        self._command("pause")

    def resume(self) -> None:
        self._command("resume")

    def stop(self) -> None:
        self._command("stop")

    def _command(self, command: str) -> None:
        """Through the control file; a command given while the run is still setting up (its control
        file is not read yet) waits until it trains, except a stop of the app's own child, which is
        a SIGTERM at once (it stops set-up too, with no checkpoint to lose)."""
        with self._lock:
            if not self._training:
                if command == "stop" and self.child is not None:
                    self.child.terminate()
                else:
                    self._pending = command
                return
        self._write(command)

    def _write(self, command: str) -> None:
        try:
            write_control(self.run_dir, command)
        except UserError:
            pass  # the folder went away: the loop reports how the run ended

    def detach(self) -> None:
        """Stop following; the run goes on (a child too, in its own session)."""
        self._detach.set()


def follow(run_dir: str | Path) -> FollowWorker:
    """Follow a run folder another process writes."""
    return FollowWorker(run_dir)


def start_child(
    config: RunConfig | None, resume_from: str | None = None, overrides: dict[str, Any] | None = None
) -> FollowWorker:
    """Start ``multilane train`` for ``config`` (or to resume ``resume_from``) and follow its folder."""
    if not resume_from:
        child = ChildRun.start(config)
        return FollowWorker(child.run_dir, child)
    follower = RunFollower(Path(resume_from).expanduser(), check_writer=False)
    follower.skip_existing()  # before the child starts: the window shows the run so far from its folder
    child = ChildRun.resume(resume_from, overrides)
    return FollowWorker(child.run_dir, child, follower)
