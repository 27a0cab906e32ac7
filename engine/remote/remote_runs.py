"""The run folders in a host's runs folder, read over SFTP: what the window lists to resume one there,
and whether one is still live (a resume of a live run is refused before anything starts there).

A run is live when its status is not final and the process named in its ``.lock`` still exists on the
host (``kill -0`` over SSH). The lock itself is a ``flock`` that only a process on the host can ask
about; the pid in it is what the host's own launcher names in its "in use by pid N" refusal.
"""

from __future__ import annotations

import json
import posixpath
import shlex
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from multilane.engine.display.terminal_text import printable
from multilane.engine.remote.connection import Connection, RemoteError
from multilane.engine.rundir.follow import DIVERGED
from multilane.engine.rundir.runlog import STATUS

FINAL = ("finished", "stopped", "failed", DIVERGED)
LOCK = ".lock"  # engine/rundir/run_lock.py's LOCK, read here as a file on the host
MAX_JSON = 1 << 20  # a status or lock file larger than this is not one a run wrote


@dataclass
class RemoteRunRow:
    """One run folder on a host, as the resume list shows it."""

    path: str
    name: str
    state: str | None  # None: no readable status.json
    step: int | None
    total_steps: int | None
    mtime: float
    checkpoint: bool
    live_pid: int | None = None  # set when the run's process still exists there

    @property
    def live(self) -> bool:
        return self.live_pid is not None


def _read_small(sftp: Any, path: str) -> bytes | None:
    """A small file's bytes: a regular file only (a FIFO there would block the read for ever)."""
    from multilane.engine.remote.mirror_copy import NotAFile, lstat_regular, open_checked

    try:
        st = lstat_regular(sftp, path)
        if st is None:
            return None
        with open_checked(sftp, path, st) as f:
            return f.read(MAX_JSON)
    except (OSError, NotAFile):
        return None


def _status(sftp: Any, folder: str) -> dict[str, Any]:
    data = _read_small(sftp, posixpath.join(folder, STATUS))
    try:
        status = json.loads(data) if data else {}
    except ValueError:
        return {}
    return status if isinstance(status, dict) else {}


def remote_status(conn: Connection, folder: str) -> dict[str, Any] | None:
    """The run's status.json in the host's ``folder`` (None: none there, or not a JSON object)."""
    with conn.lock:
        sftp = conn.sftp()
        data = _read_small(sftp, posixpath.join(folder, STATUS))
    try:
        status = json.loads(data) if data else None
    except ValueError:
        return None
    return status if isinstance(status, dict) else None


def _lock_pid(sftp: Any, folder: str) -> int | None:
    data = _read_small(sftp, posixpath.join(folder, LOCK))
    first = (data or b"").decode("utf-8", "replace").strip().split("\n")[0].strip()
    return int(first) if first.isdigit() else None


def alive_pids(conn: Connection, pids: list[int]) -> set[int]:
    """Which of ``pids`` exist on the host now (one command for all of them)."""
    if not pids:
        return set()
    words = " ".join(shlex.quote(str(p)) for p in pids)
    _, out, _ = conn.run(f"for p in {words}; do kill -0 $p 2>/dev/null && echo $p; done; true", login=False)
    return {int(w) for w in out.split() if w.isdigit()}


def live_pid(conn: Connection, folder: str) -> int | None:
    """The pid of the process still writing the host's run ``folder``, or None."""
    with conn.lock:
        sftp = conn.sftp()
        state = _status(sftp, folder).get("state")
        pid = _lock_pid(sftp, folder)
    if state in FINAL or pid is None:
        return None
    return pid if pid in alive_pids(conn, [pid]) else None


def refuse_live(conn: Connection, folder: str) -> None:
    """One line when a run still trains in ``folder`` there: one run writes to a folder at a time."""
    pid = live_pid(conn, folder)
    if pid is not None:
        raise RemoteError(
            f"{conn.name}: run {folder} is in use by pid {pid} there; one run writes to a folder at a time "
            "(stop it, or follow it with File > Follow run)"
        )


def runs_folder_there(conn: Connection, runs_dir: str | None) -> str | None:
    """The host's runs folder as an absolute path, or None when it does not exist (a listing makes
    nothing there, unlike a launch)."""
    from multilane.engine.remote.launch import DEFAULT_REMOTE_RUNS, absolute_there

    return absolute_there(conn, runs_dir or DEFAULT_REMOTE_RUNS)


def list_runs(conn: Connection, runs: str) -> list[RemoteRunRow]:
    """The run folders (those with a ``config.json``) in the host's ``runs`` folder, newest first."""
    rows: list[RemoteRunRow] = []
    with conn.lock:
        sftp = conn.sftp()
        try:
            entries = sftp.listdir_attr(runs)
        except OSError as e:
            raise RemoteError(f"{conn.name}: cannot list the runs folder {printable(runs)} there ({e})") from None
        except UnicodeDecodeError:  # paramiko reads names as UTF-8, strictly
            raise RemoteError(
                f"{conn.name}: the runs folder {printable(runs)} there holds a name that is not UTF-8; rename it"
            ) from None
        for entry in entries:
            if entry.filename.startswith(".") or not stat.S_ISDIR(entry.st_mode or 0):
                continue
            folder = posixpath.join(runs, entry.filename)
            try:
                sftp.stat(posixpath.join(folder, "config.json"))
            except OSError:
                continue  # not a run folder
            status = _status(sftp, folder)
            try:
                sftp.stat(posixpath.join(folder, "checkpoints", "last.pt"))
                checkpoint = True
            except OSError:
                checkpoint = False
            step, total = status.get("step"), status.get("total_steps")
            state = status.get("state")
            rows.append(
                RemoteRunRow(
                    path=folder,
                    name=entry.filename,
                    state=state if isinstance(state, str) else None,
                    step=step if isinstance(step, int) else None,
                    total_steps=total if isinstance(total, int) else None,
                    mtime=max(float(entry.st_mtime or 0), float(status.get("updated") or 0)),
                    checkpoint=checkpoint,
                    live_pid=None if state in FINAL else _lock_pid(sftp, folder),
                )
            )
    alive = alive_pids(conn, sorted({r.live_pid for r in rows if r.live_pid is not None}))
    for r in rows:
        if r.live_pid not in alive:
            r.live_pid = None
    rows.sort(key=lambda r: (r.mtime, r.name), reverse=True)
    return rows


def resume_followed(
    conn: Connection, folder: str, local: Path, overrides: dict[str, Any] | None = None, start: Any = None
) -> tuple[Any, Any]:
    """Resume the host's run ``folder`` there and follow it through its mirror ``local``: (the
    ``RemoteRun``, a ``RemoteFollower``). The mirror is brought up to date first (every record: the
    curves so far) and its old final status set aside, so the follow ends with the new process's final
    status, as a started run's does. The window and ``train --host H --resume`` both come here."""
    from multilane.engine.errors import UserError
    from multilane.engine.remote.launch import resume_run
    from multilane.engine.remote.mirror import REMOTE, RemoteFollower, RemoteMirror, write_atomic

    refuse_live(conn, folder)  # before a mirror is made here for it
    made = not local.exists()
    mirror = RemoteMirror(conn, folder, local)
    try:
        mirror.sync()
        while mirror.behind:  # a long metrics.jsonl: every record in before the old status is set aside
            mirror.sync()
        follower = RemoteFollower(mirror)
        follower.local.skip_status()
        run = start() if start is not None else resume_run(conn, folder, overrides)  # start: across hosts
    except UserError:
        if made:
            shutil.rmtree(local, ignore_errors=True)
        raise
    mirror.pid = run.pid  # the new process: the follower checks it is alive
    body = {"host": conn.name, "path": run.path, "remote_command": conn.remote_command, "pid": run.pid}
    write_atomic(local / REMOTE, (json.dumps(body, indent=2) + "\n").encode())
    return run, follower
