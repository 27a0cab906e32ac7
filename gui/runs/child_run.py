"""A run the app starts as a child process: ``multilane train`` with the window's config and run folder.

Every strategy can run this way (ddp always does: its ranks are processes). The app makes the run
folder first and hands it to the child (``MULTILANE_RUN_DIR``), so it knows which folder to follow
before the child has written anything. The child runs in its own session: Ctrl+C in the terminal
that started the app does not reach it, and it can outlive the app (see ``docs/app.md``). Its console
output goes to ``console.log`` in the run folder.

Nothing here imports Qt: ``gui/runs/follow.py`` polls a ``ChildRun`` from the window's worker thread.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from multilane.engine.config import RunConfig
from multilane.engine.distributed import RUN_DIR_ENV
from multilane.engine.errors import UserError
from multilane.engine.rundir.runlog import CONFIG, ERROR, METRICS, STATUS, TASK_FILE, RunDir, iter_metrics
from multilane.engine.tasks.loader import check_resume_task_file, is_task_file

CONSOLE = "console.log"
TRAIN = [sys.executable, "-m", "multilane.engine.cli", "train"]


class ChildRun:
    """One ``multilane train`` process and the run folder it writes."""

    def __init__(self, args: list[str], run_dir: Path, made_folder: bool) -> None:
        self.run_dir = run_dir
        self.made_folder = made_folder  # a rejected run leaves no folder behind, as in the app's thread
        self.log_path = run_dir / CONSOLE
        # What a resume found: a resume refused before it began leaves the folder as it was.
        self._metrics_size0 = _size(run_dir / METRICS)
        self._console_size0 = _size(self.log_path)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [*TRAIN, *args],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, RUN_DIR_ENV: str(run_dir)},
                start_new_session=True,
            )
        self.terminated = False

    # -- starting ----------------------------------------------------------------------------------
    @classmethod
    def start(cls, config: RunConfig) -> ChildRun:
        """A new run of ``config``; bad input (an unwritable runs folder) raises ``UserError``."""
        made = RunDir.create(config.run.runs_dir, config.run.name)
        made.close()  # the child takes the folder's lock: it is the run's writer
        made.write_json(CONFIG, config.to_dict())  # the child reads it, and rewrites it as it runs
        return cls(["--config", str(made.path / CONFIG)], made.path, made_folder=True)

    @classmethod
    def resume(cls, run_dir: str | Path, overrides: dict[str, Any] | None = None) -> ChildRun:
        """Continue the run in ``run_dir``. A task file that changed since raises ``TaskFileChanged``
        here, before any process starts, so the window can ask as it does for a run in its thread."""
        rd = RunDir.open_existing(run_dir, lock=False)  # checked: a folder with a checkpoint
        overrides = dict(overrides or {})
        name = ((rd.read_json(CONFIG) or {}).get("task") or {}).get("name")
        if isinstance(name, str) and is_task_file(name) and "task.name" not in overrides:
            check_resume_task_file(name, rd.read_json(TASK_FILE))
        args = ["--resume", str(rd.path)]
        for key, value in overrides.items():
            args += ["--set", f"{key}={value if isinstance(value, str) else json.dumps(value)}"]
        return cls(args, rd.path, made_folder=False)

    # -- watching ----------------------------------------------------------------------------------
    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the process to end; True when it has."""
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return False
        return True

    def terminate(self) -> None:
        """SIGTERM: ``multilane train`` finishes its step (or its set-up) and stops with a checkpoint."""
        if self.proc.poll() is None and not self.terminated:
            self.terminated = True  # once: a second SIGTERM would abort the run
            self.proc.send_signal(signal.SIGTERM)

    def stop_and_wait(self, timeout_s: float = 60.0) -> bool:
        """Stop the run with a checkpoint and wait for the process (a ddp launcher waits for its ranks)."""
        self.terminate()
        return self.wait(timeout_s)

    # -- how it ended ------------------------------------------------------------------------------
    def outcome(self, step: int) -> dict[str, Any]:
        """The result of a child that ended without writing a final status (bad input, killed, crashed).

        Bad input (exit 2 before training began) is "rejected" with the CLI's one line, and the folder
        the app made is removed. A killed or crashed child is "failed"; the app, its supervisor, records
        that in the run folder (status.json, a failed event), as the trainer would have.
        """
        code = self.proc.returncode
        line = self._last_line()
        started = _size(self.run_dir / METRICS) not in (None, self._metrics_size0)
        if code == 2 and not started:
            if self.made_folder:
                self._remove_made_folder()
            else:
                self._restore_console_log()
            message = line.removeprefix("multilane: error: ") or "the run was not started"
            return {"status": "rejected", "message": message, "step": 0, "run_dir": "", "traceback": None}
        if self.terminated and code == -signal.SIGTERM and not started:
            # Stopped by the app before the CLI had set its handler up: nothing trained, nothing to keep.
            if self.made_folder:
                self._remove_made_folder()
            return {"status": "stopped", "message": "before training began", "step": 0, "run_dir": ""}
        if code is not None and code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            message = f"the training process was killed ({name}) after step {step}"
        elif code == 0:
            return {"status": "finished", "message": None, "step": step, "run_dir": str(self.run_dir)}
        else:
            message = f"the training process exited with status {code} after step {step}: {line}"
        self._record_failure(message, step)
        return {"status": "failed", "message": message, "step": step, "run_dir": str(self.run_dir), "traceback": None}

    def _last_line(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - 8192))
                lines = f.read().decode("utf-8", "replace").strip().splitlines()
        except OSError:
            return ""
        errors = [x for x in lines if x.startswith(("multilane: error:", "failed:"))]
        return (errors or lines or [""])[-1].strip()

    def _restore_console_log(self) -> None:
        """A refused resume's console output is not the run's: its console.log is put back as it was."""
        try:
            if self._console_size0 is None:
                self.log_path.unlink()
            else:
                os.truncate(self.log_path, self._console_size0)
        except OSError:
            pass

    def _remove_made_folder(self) -> None:
        known = {CONFIG, CONSOLE, "checkpoints", ".lock"}
        try:
            names = {p.name for p in self.run_dir.iterdir()}
            if names <= known and not any((self.run_dir / "checkpoints").iterdir()):
                shutil.rmtree(self.run_dir)
        except OSError:
            pass  # an empty run folder left behind is harmless

    def _record_failure(self, message: str, step: int) -> None:
        rd = RunDir(self.run_dir)
        try:
            rd.acquire(2.0)  # the child's lock went with it
        except UserError:
            return  # someone else writes the folder now: theirs to record
        try:
            old = rd.read_json(STATUS) or {}
            if old.get("state") in ("finished", "stopped", "failed"):
                return
            if not (self.run_dir / ERROR).exists():
                rd.write_error(message + "\n")
            rd.set_status("failed", message, step=step, total_steps=old.get("total_steps"))
            rd.append_metric(
                {"kind": "event", "event": "failed", "step": step, "wall_time": time.time(), "message": message}
            )
        except OSError:
            pass
        finally:
            rd.close()


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


def last_logged_step(run_dir: Path) -> int:
    """The last train step in the run's metrics.jsonl (0 when none)."""
    return max((r.get("step", 0) for r in iter_metrics(run_dir / METRICS) if r.get("kind") == "train"), default=0)
