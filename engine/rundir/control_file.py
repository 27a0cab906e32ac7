"""A control file in the run directory: pause, resume or stop a run from another process or machine.

``multilane control RUN_DIR stop`` (or the app following a run) writes ``control.json``; the trainer
(every rank of a ddp run) polls it between steps. Polling is cheap: a clock read per step and one
``os.stat`` every ``every_s`` seconds; the file is read only when its stamp (inode, mtime, size)
changes. Writes are atomic (a rename), so every change gives a new stamp. A command written before
the run started (say, the ``stop`` that ended the run now being resumed) is not for this run: the
stamp seen at start is the baseline.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from multilane.engine.errors import UserError
from multilane.engine.rundir.readfile import describe_os_error, read_regular_file, user_path
from multilane.engine.rundir.runs_folder import NOT_A_RUN, run_folder_problem, says_it_is_a_run
from multilane.engine.rundir.writefile import atomic_write_bytes

if TYPE_CHECKING:  # the loop hands its RunControl in; the run folder sits below the loop
    from multilane.engine.run.control import RunControl

CONTROL = "control.json"
COMMANDS = ("pause", "resume", "stop")


REASON_MAX = 200


def write_control(run_dir: str | Path, command: str, reason: str | None = None) -> Path:
    """Ask the run in ``run_dir`` to pause, resume or stop (atomically; the newest command wins);
    ``reason`` (a stop's: "pruned by the sweep's pruner at step 50") ends up in the run's end message."""
    if command not in COMMANDS:
        raise UserError(f"control: unknown command {command!r}; use {', '.join(COMMANDS)}")
    folder = user_path(run_dir, "control")
    try:
        if not folder.is_dir():
            raise UserError(f"control: {run_folder_problem(folder)}")
    except ValueError as e:  # an embedded NUL
        raise UserError(f"control: not a usable path ({e})") from None
    try:
        if not says_it_is_a_run(folder):  # an empty folder, a documents folder, a TensorBoard logdir
            raise UserError(f"control: {folder} is not a run folder ({NOT_A_RUN}); nothing written")
    except OSError as e:
        raise UserError(f"control: {folder}: cannot read it ({describe_os_error(e)})") from None
    path = folder / CONTROL
    if path.is_dir() and not path.is_symlink():  # os.replace would say only "Is a directory"
        raise UserError(f"control: {path} is a folder; remove it to control the run")
    asked: dict[str, object] = {"command": command, "time": time.time(), "pid": os.getpid()}
    if reason:
        asked["reason"] = reason[:REASON_MAX]
    data = json.dumps(asked) + "\n"
    try:
        atomic_write_bytes(path, data.encode())
    except OSError as e:
        raise UserError(f"control: cannot write {path} ({describe_os_error(e)})") from None
    return path


class ControlFile:
    """Polls ``RUN_DIR/control.json`` for new commands."""

    def __init__(self, run_dir: str | Path, every_s: float = 0.25) -> None:
        self.path = Path(run_dir) / CONTROL
        self.every_s = every_s
        self._seen = self._stamp()  # commands from before this run are not for it
        self._next = 0.0
        self.reason: str | None = None  # the last command's reason, if it gave one

    def _stamp(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def poll(self) -> str | None:
        """A command written since the last poll, or None (also between two stats)."""
        now = time.monotonic()
        if now < self._next:
            return None
        self._next = now + self.every_s
        stamp = self._stamp()
        if stamp is None or stamp == self._seen:
            return None
        self._seen = stamp
        try:  # never a plain open: a FIFO named control.json would block the training loop
            asked = json.loads(read_regular_file(self.path, 1 << 16))
            command = asked.get("command")
        except (OSError, ValueError, AttributeError, RecursionError):
            return None
        reason = asked.get("reason")
        self.reason = " ".join(reason.split())[:REASON_MAX] if isinstance(reason, str) and reason.strip() else None
        return command if command in COMMANDS else None

    def apply(self, control: RunControl) -> str | None:
        """Poll and apply a new command to ``control``; returns it."""
        command = self.poll()
        if command == "stop":
            control.request_stop(self.reason)
        elif command == "pause":
            control.pause()
        elif command == "resume":
            control.resume()
        return command
