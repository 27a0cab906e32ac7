"""A run on a host over SSH, in the window: started there (or found still training there), followed
through its local mirror folder by the same ``FollowWorker`` loop as a local run folder.

The connection is opened and the run launched in the worker's thread, never in the GUI thread (a host
that does not answer takes its timeout). While the host is out of reach the worker emits
``connection`` with "reconnecting to HOST…", then None once it is back. Pause, Resume and Stop write
the run's control file there, also from a thread of their own. No Qt here beyond the worker's signals.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from multilane.engine.display.terminal_text import printable
from multilane.engine.errors import UserError
from multilane.engine.remote.connection import Connection, NotGiven
from multilane.engine.remote.launch import launch_run
from multilane.engine.remote.mirror import RemoteFollower, RemoteMirror, mirror_folder, read_remote_json
from multilane.engine.remote.remote_runs import resume_followed
from multilane.engine.rundir.follow import DIVERGED
from multilane.gui.runs.follow import FollowWorker
from PySide6.QtCore import Signal


class RemoteFollowWorker(FollowWorker):
    """Launches (or reattaches to) a run on a host and follows its mirror."""

    connection = Signal(object)  # "reconnecting to HOST…", or None when the host answers again

    def __init__(
        self,
        host: str,
        local_runs: str | Path,
        remote_command: str = "multilane",
        config: dict[str, Any] | None = None,
        remote_runs: str | None = None,
        mirror: str | Path | None = None,
        resume: str | None = None,
        ask: Callable[[str], str | None] | None = None,
    ) -> None:
        # QObject's own __init__ first: a Qt object is set up before anything is stored on it
        super().__init__(Path(mirror) if mirror else Path(local_runs), follower=_Pending())
        self.host, self.remote_command = host, remote_command
        self.config, self.remote_runs, self.resume_dir = config, remote_runs, resume
        self.ask = ask  # a password or passphrase, asked in the window (gui/hosts/secrets.py)
        self.local_runs = Path(local_runs)
        self.mirror_dir = Path(mirror) if mirror else None
        self._shown: str | None = None
        self._warning: str | None = None
        self.control_error: str | None = None

    def _loop(self) -> dict[str, Any]:
        # (in the worker's thread: ``run`` itself is not overridden, as PySide would then call the
        # override in the thread that emits ``QThread.started``'s connection, the GUI thread)
        try:
            self._connect()
        except UserError as e:  # no answer, a refused key, no multilane there: said, nothing started
            cancelled = isinstance(e, NotGiven)  # the user cancelled the password box: the line is enough
            return {"status": "rejected", "message": str(e), "step": 0, "run_dir": "", "cancelled": cancelled}
        # the window learns the mirror now: the first ``started`` named the local runs folder (nothing
        # was connected yet), and the next comes only once the run's status gives its step count
        self.started.emit(self._info())
        return super()._loop()

    def _connect(self) -> None:
        conn = Connection(self.host, remote_command=self.remote_command, ask=self.ask)
        done = getattr(self.ask, "done", None)  # the window keeps a secret that connected, for reconnects
        try:
            conn.connect()
        except UserError:
            if done is not None:
                done(False)
            raise
        if done is not None:
            done(True)
        info = read_remote_json(self.mirror_dir) if self.mirror_dir else None
        if info is not None and not self.resume_dir:  # a run still training there: reattach
            mirror = RemoteMirror(conn, info["path"], self.mirror_dir)
        elif self.resume_dir:
            self._resume(conn)
            return
        else:
            run = launch_run(conn, self.config or {}, self.remote_runs)
            local = self.mirror_dir or mirror_folder(self.local_runs, conn.spec.label, run.path)
            mirror = RemoteMirror(conn, run.path, local, run)
        self.run_dir = mirror.local
        self.follower = RemoteFollower(mirror)

    def _resume(self, conn: Connection) -> None:
        """Resume the host's run folder there (``resume_followed``: the mirror brought up to date, its old
        final status set aside; the window shows the curves so far, then the new steps)."""
        local = self.mirror_dir or mirror_folder(self.local_runs, conn.spec.label, self.resume_dir)
        _, follower = resume_followed(conn, self.resume_dir, local)
        self.run_dir, self.follower = local, follower

    def _poll(self) -> None:
        super()._poll()
        note = getattr(self.follower, "reconnecting", None)
        note = note.split(" (")[0] if note else None
        for warning in getattr(self.follower, "new_warnings", list)():  # a link or FIFO in a file's place
            self._warning = f"warning: {printable(warning)}"
        # a long copy shows its progress ("catching up metrics.jsonl: 96 / 500 MB"), then the last warning
        note = note or getattr(self.follower, "catching_up", None) or self._warning
        if note != self._shown:
            self._shown = note
            self.connection.emit(note)

    def _write(self, command: str) -> None:
        follower = self.follower

        def send() -> None:
            try:
                follower.control(command)
            except (UserError, OSError, EOFError) as e:  # out of reach: the status bar says so; the run goes on
                self.control_error = f"{command}: {e}"

        threading.Thread(target=send, name="multilane-remote-control", daemon=True).start()


class _Pending:
    """The follower before the connection is up: nothing yet, nothing done."""

    status = None
    lost = None
    done = False


def unfinished_mirrors(local_runs: str | Path) -> list[Path]:
    """Mirror folders under ``local_runs`` whose run, on its host, had not ended when last seen."""

    out = []
    root = Path(local_runs).expanduser()
    try:
        folders = sorted(p for p in root.iterdir() if p.is_dir())
    except OSError:
        return []
    for folder in folders:
        if read_remote_json(folder) is None:
            continue
        try:
            state = json.loads((folder / "status.json").read_text(encoding="utf-8")).get("state")
        except (OSError, ValueError, AttributeError):
            state = None
        if state not in ("finished", "stopped", "failed", DIVERGED):
            out.append(folder)
    return out
