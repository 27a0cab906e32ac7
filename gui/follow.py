"""Runs the window shows but does not run in its own thread: a run folder another process writes
(File > Follow run), and a ddp run the app starts as a child process (``multilane train``).

Both are read the same way: a timer in the GUI thread polls the folder with the engine's
``RunFollower`` (incremental: only the bytes appended to metrics.jsonl since the last tick are read)
and emits the same ``started``/``record``/``finished`` signals as the in-process worker, so the window
shows them exactly like a local run. Pause, Resume and Stop write the run folder's control file,
which every rank polls between steps, so they work for a run on another machine too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from multilane.engine.config import RunConfig
from multilane.engine.control_file import write_control
from multilane.engine.distributed.worker import RUN_DIR_ENV
from multilane.engine.follow import RunFollower
from multilane.engine.runlog import CONFIG, RunDir
from PySide6.QtCore import QObject, QTimer, Signal

POLL_MS = 250


class _NoHold:
    """A followed run is in another process: the window's redraw hold does not apply."""

    def hold(self, max_s: float) -> None: ...
    def release(self) -> None: ...
    def request_stop(self) -> None: ...

    def wait_until_held(self, timeout: float) -> bool:
        return True


class _NoThread:
    def wait(self, timeout_ms: int = 0) -> bool:
        return True


class FollowWorker(QObject):
    """Polls one run folder and emits what it finds, like ``TrainWorker``."""

    started = Signal(object)
    record = Signal(object)
    finished = Signal(object)

    def __init__(self, run_dir: str | Path, child: subprocess.Popen | None = None, stderr_path: Path | None = None):
        super().__init__()
        self.run_dir = Path(run_dir)
        self.child, self.stderr_path = child, stderr_path
        self.follower = RunFollower(self.run_dir)
        self.timer = QTimer(self)
        self.timer.timeout.connect(self.poll)
        self._step = 0
        self._total: int | None = None
        self._done = False

    def start(self) -> None:
        cfg = RunDir(self.run_dir).read_json(CONFIG) or {}
        self.started.emit({"run_dir": str(self.run_dir), "total_steps": None, "step": 0, "devices": self._devices(cfg)})
        self.poll()
        if not self._done:
            self.timer.start(POLL_MS)

    @staticmethod
    def _devices(cfg: dict[str, Any]) -> list[str]:
        use = (cfg.get("devices") or {}).get("use")
        return [s.strip() for s in use.split(",")] if isinstance(use, str) else []

    def poll(self) -> None:
        if self._done:
            return
        update = self.follower.poll()
        for rec in update.records:
            if rec.get("kind") == "train":
                self._step = rec.get("step", self._step)
            self.record.emit(rec)
        status = update.status
        if status is not None and status.get("total_steps") and self._total is None:
            self._total = status["total_steps"]  # now the window can show progress and an ETA
            devices = self._devices(RunDir(self.run_dir).read_json(CONFIG) or {})
            self.started.emit(
                {"run_dir": str(self.run_dir), "total_steps": self._total, "step": self._step, "devices": devices}
            )
        if self.follower.done:
            self._end(self.follower.status or {})
        elif self.child is not None and self.child.poll() is not None:
            # The child ended without a final status: bad input (one line on its stderr) or a crash.
            self._end({"state": "failed" if self.child.returncode else "finished", "message": self._child_error()})

    def _child_error(self) -> str:
        try:
            lines = self.stderr_path.read_text(errors="replace").strip().splitlines() if self.stderr_path else []
        except OSError:
            lines = []
        return lines[-1] if lines else f"the training process exited with status {self.child.returncode}"

    def _end(self, status: dict[str, Any]) -> None:
        self._done = True
        self.timer.stop()
        self.finished.emit(
            {
                "status": status.get("state", "finished"),
                "step": status.get("step") or self._step,
                "run_dir": str(self.run_dir),
                "message": status.get("message"),
                "traceback": None,
            }
        )

    def pause(self) -> None:
        write_control(self.run_dir, "pause")

    def resume(self) -> None:
        write_control(self.run_dir, "resume")

    def stop(self) -> None:
        write_control(self.run_dir, "stop")


class FollowedRun:
    """What the window holds for a followed run (the same face as ``worker.RunHandle``)."""

    def __init__(self, worker: FollowWorker) -> None:
        self.worker = worker
        self.control = _NoHold()
        self.thread = _NoThread()

    def start(self) -> None:
        self.worker.start()

    def stop_and_wait(self, timeout_ms: int = 60_000) -> bool:
        self.worker.stop()
        child = self.worker.child
        if child is None:
            return True
        try:
            child.wait(timeout_ms / 1000)
        except subprocess.TimeoutExpired:
            return False
        return True


def follow(run_dir: str | Path) -> FollowedRun:
    """Follow a run folder another process writes."""
    return FollowedRun(FollowWorker(run_dir))


def start_child_run(config: RunConfig) -> FollowedRun:
    """Start ``multilane train`` with ``config`` as a child process (a ddp run: its launcher and
    ranks) and follow the run folder made for it."""
    run_dir = RunDir.create(config.run.runs_dir, config.run.name).path
    cfg_path = Path(tempfile.mkdtemp(prefix="multilane-")) / "config.json"
    cfg_path.write_text(json.dumps(config.to_dict()))
    stderr_path = cfg_path.with_name("stderr.txt")
    env = {**os.environ, RUN_DIR_ENV: str(run_dir)}
    with open(stderr_path, "wb") as err:
        child = subprocess.Popen(
            [sys.executable, "-m", "multilane.engine.cli", "train", "--config", str(cfg_path)],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=env,
        )
    return FollowedRun(FollowWorker(run_dir, child, stderr_path))
