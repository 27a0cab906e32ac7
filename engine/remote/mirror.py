"""Following a run on a host: its run folder copied, incrementally, into a local mirror folder.

``metrics.jsonl`` and ``console.log`` only grow: each poll reads the bytes past the mirror's own size
(SFTP, by byte offset), so a connection that drops and comes back resumes where the mirror ends: no
gap, no duplicate, the two files equal byte for byte. ``status.json`` and the other small files are
rewritten whole by the run: they are copied when their (mtime, size) changes, and written into the
mirror atomically. Checkpoints are not copied. The mirror is a complete run folder (export, compare,
the runs table and Open run read it offline); ``remote.json`` in it says where the run lives.

``RemoteFollower`` polls like the engine's ``RunFollower`` (which reads the mirror), and says
"reconnecting to HOST…" while the host is out of reach.
"""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import shlex
import time
from pathlib import Path
from typing import Any

from multilane.engine.display.terminal_text import printable
from multilane.engine.remote.connection import Connection, Disconnected, RemoteError
from multilane.engine.remote.launch import CONSOLE, RemoteRun, write_remote_control
from multilane.engine.remote.mirror_copy import NotAFile, lstat_regular, open_checked, read_range, still_regular
from multilane.engine.remote.ssh import paramiko
from multilane.engine.rundir.follow import FollowUpdate, RunFollower
from multilane.engine.rundir.runlog import CONFIG, ENVIRONMENT, ERROR, METRICS, SAMPLES, STATUS, TASK_FILE

REMOTE = "remote.json"  # in a mirror: the host and the run folder there
APPENDED = (METRICS, CONSOLE)
REPLACED = (STATUS, CONFIG, ENVIRONMENT, ERROR, TASK_FILE, SAMPLES)
RETRY_S = 2.0  # between two reconnection attempts
MB = 1 << 20
PID_CHECK_S = 10.0  # how often a running run's process on the host is checked


def mirror_folder(local_runs: str | Path, host_label: str, remote_path: str) -> Path:
    """Where the mirror of the host's run folder goes, under the local runs folder."""
    name = printable(posixpath.basename(remote_path.rstrip("/")))  # no control character in a local name
    return Path(local_runs).expanduser() / f"{name}@{host_label}"


def read_remote_json(folder: str | Path) -> dict[str, Any] | None:
    """A mirror's ``remote.json`` (None for a folder that mirrors no remote run)."""
    try:
        data = json.loads((Path(folder) / REMOTE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("host"), str) else None


SAME_SECOND_S = 1.5  # a stamp seen this long ago cannot change within its second any more


class RemoteMirror:
    """Copies one run folder on a host into a local folder; ``sync()`` raises ``Disconnected``.

    Regular files only (``mirror_copy.py``): anything else in a file's place is one warning (``warnings``)
    and skipped. A replaced file larger than ``max_whole`` is skipped with a warning; a growing file is
    copied ``chunk`` bytes at a time, at most ``budget`` bytes a sync, so a long catch-up (a 500 MB
    metrics.jsonl) shows its progress (``catching_up``) and the records so far."""

    max_whole = 16 << 20
    chunk = 2 << 20
    budget = 8 << 20  # a poll's records are parsed at once by the follower: ~80 MB of them for 8 MB

    def __init__(self, conn: Connection, remote_dir: str, local_dir: str | Path, run: RemoteRun | None = None) -> None:
        self.conn, self.remote_dir, self.local = conn, remote_dir, Path(local_dir)
        self.local.mkdir(parents=True, exist_ok=True)
        info = read_remote_json(self.local) or {}
        self.pid = run.pid if run is not None else info.get("pid")
        if run is not None or not info:
            body = {"host": conn.name, "path": remote_dir, "remote_command": conn.remote_command, "pid": self.pid}
            if run is not None and run.nodes:  # a run across hosts: every node's launcher (multi_host.py)
                body["nodes"] = run.nodes
            write_atomic(self.local / REMOTE, (json.dumps(body, indent=2) + "\n").encode())
        self._stamps: dict[str, tuple[int, int]] = {}
        self._stamp_seen: dict[str, float] = {}  # when each stamp was first seen (time.monotonic)
        self._copied: dict[str, bytes] = {}  # what was copied of each replaced file
        self._warned: dict[str, str] = {}  # the warning given for each file, once
        self.warnings: list[str] = []  # every warning so far, in order (a follower passes on the new ones)
        self.behind: dict[str, tuple[int, int]] = {}  # a growing file not yet caught up: (copied, size)

    @property
    def catching_up(self) -> str | None:
        """ "catching up metrics.jsonl: 96 / 500 MB" while a growing file is behind, else None."""
        if not self.behind:
            return None
        name, (have, size) = next(iter(self.behind.items()))
        return f"catching up {name}: {have / MB:,.1f} / {size / MB:,.1f} MB"

    def _warn(self, name: str, what: str) -> None:
        if self._warned.get(name) != what:
            self._warned[name] = what
            self.warnings.append(
                f"{printable(self.conn.name)}:{printable(posixpath.join(self.remote_dir, name))}: {what}"
            )

    def _regular(self, sftp: Any, name: str) -> Any | None:
        try:
            st = lstat_regular(sftp, posixpath.join(self.remote_dir, name))
        except NotAFile as e:
            self._warn(name, f"{e} is in a file's place; skipped, never followed")
            return None
        if st is not None:
            self._warned.pop(name, None)
        return st

    def sync(self) -> bool:
        """Copy what changed since the last sync; True when anything did."""
        pm = paramiko()
        try:
            with self.conn.lock:
                sftp = self.conn.sftp()
                # status first, written last: a final status is mirrored only after every record before it
                replaced = {name: self._changed(sftp, name) for name in REPLACED}
                grew = [self._append(sftp, name) for name in APPENDED]
        except (EOFError, pm.SSHException, OSError) as e:
            if isinstance(e, RemoteError):
                raise
            self.conn.close()
            raise Disconnected(f"{self.conn.name}: the connection dropped ({e or type(e).__name__})") from None
        if self.behind and replaced.get(STATUS) is not None:  # records still to come: that status waits
            replaced[STATUS] = None
            self._stamps.pop(STATUS, None)
            self._copied.pop(STATUS, None)
        for name, data in replaced.items():
            if data is not None:
                write_atomic(self.local / name, data)
        return any(grew) or any(d is not None for d in replaced.values())

    def _changed(self, sftp: Any, name: str) -> bytes | None:
        path = posixpath.join(self.remote_dir, name)
        st = self._regular(sftp, name)
        if st is None:
            return None
        stamp = (int(st.st_mtime or 0), int(st.st_size or 0))
        if stamp[1] > self.max_whole:
            self._warn(name, f"{stamp[1]:,} bytes, more than the {self.max_whole:,} copied whole; skipped")
            return None
        now = time.monotonic()
        if self._stamps.get(name) != stamp:
            self._stamp_seen[name] = now
        elif (self.local / name).exists() and now - self._stamp_seen.get(name, now) > SAME_SECOND_S:
            return None
        # SFTP gives whole-second mtimes: a file rewritten in the same second at the same size (a status
        # going from "running" to "finished") keeps its stamp. Until its second has surely passed (the
        # host's clock read that second when we first saw it), the file is read again and compared.
        try:
            with open_checked(sftp, path, st) as f:
                data = f.read(self.max_whole + 1)  # to its end (small: sequential reads), at most the cap
            still_regular(sftp, path, st)
        except FileNotFoundError:  # replaced between stat and open: the next sync reads it
            return None
        except NotAFile as e:
            self._warn(name, f"{e}; skipped")
            return None
        if len(data) > self.max_whole:
            self._warn(name, f"more than the {self.max_whole:,} bytes copied whole; skipped")
            return None
        if self._stamps.get(name) == stamp and self._copied.get(name) == data and (self.local / name).exists():
            return None
        self._stamps[name] = stamp
        self._copied[name] = data
        return data

    def _append(self, sftp: Any, name: str) -> bool:
        path, local = posixpath.join(self.remote_dir, name), self.local / name
        st = self._regular(sftp, name)
        if st is None:
            self.behind.pop(name, None)
            return False
        size = int(st.st_size or 0)
        have = local.stat().st_size if local.exists() else 0
        if size == have:
            self.behind.pop(name, None)
            return False
        if size < have:  # the file was replaced there (not something a run does): copy it afresh
            have = 0
            local.write_bytes(b"")
        end, start = min(size, have + self.budget), have
        try:
            with open_checked(sftp, path, st) as f, open(local, "ab") as out:
                # only what the host holds past the mirror's end: no gap, no duplicate
                while have < end:
                    data = read_range(f, have, min(self.chunk, end - have))
                    if not data:
                        break
                    out.write(data)
                    have += len(data)
            still_regular(sftp, path, st)
        except FileNotFoundError:
            return False
        except NotAFile as e:  # what was appended may come from another file: taken back
            with open(local, "r+b") as out:
                out.truncate(start)
            self._warn(name, f"{e}; skipped")
            return False
        if have < size:
            self.behind[name] = (have, size)
        else:
            self.behind.pop(name, None)
        return True

    def process_alive(self) -> bool | None:
        """Whether the run's process still exists on the host (None: unknown)."""
        if not isinstance(self.pid, int):
            return None
        code, _, _ = self.conn.run(f"kill -0 {shlex.quote(str(self.pid))}", timeout_s=self.conn.timeout_s, login=False)
        return code == 0


class RemoteFollower:
    """Polls a remote run through its mirror: ``poll()``, ``done``, ``status``, ``lost`` as ``RunFollower``,
    plus ``reconnecting`` (the line to show while the host is out of reach) and ``control()``."""

    def __init__(self, mirror: RemoteMirror) -> None:
        self.mirror = mirror
        self.local = RunFollower(mirror.local, check_writer=False)
        self.reconnecting: str | None = None
        self.lost: str | None = None
        self._told = 0  # how many of the mirror's warnings were passed on
        self.mlflow = _mlflow_mirror(mirror.local)  # sends the records where the host hands MLflow over
        self._mlflow_told = 0
        self._retry_at = 0.0
        self._pid_at = time.monotonic() + PID_CHECK_S

    @property
    def run_dir(self) -> Path:
        return self.mirror.local

    @property
    def status(self) -> dict[str, Any] | None:
        return self.local.status

    @property
    def metrics(self) -> Any:
        return self.local.metrics

    @property
    def problem(self) -> str | None:
        """What makes the mirror unfollowable (a FIFO where a file should be), as ``RunFollower``'s."""
        return self.local.problem

    def skip_existing(self) -> None:
        self.local.skip_existing()

    @property
    def catching_up(self) -> str | None:
        """The progress of a long copy ("catching up metrics.jsonl: 96 / 500 MB"), or None."""
        return self.mirror.catching_up

    def new_warnings(self) -> list[str]:
        """The mirror's warnings not yet passed on (a link or FIFO in a file's place, a file over the cap)."""
        new = self.mirror.warnings[self._told :]
        self._told = len(self.mirror.warnings)
        if self.mlflow is not None:
            new += self.mlflow.warnings[self._mlflow_told :]
            self._mlflow_told = len(self.mlflow.warnings)
        return new

    def poll(self) -> FollowUpdate:
        now = time.monotonic()
        gone = False
        if self.reconnecting is None or now >= self._retry_at:
            try:
                self.mirror.sync()
                self.reconnecting = None
                if not self.done and now >= self._pid_at:
                    self._pid_at = now + PID_CHECK_S
                    gone = self.mirror.process_alive() is False
                    if gone:
                        self.mirror.sync()  # a final status written just before the process ended
            except Disconnected as e:
                self.reconnecting = f"reconnecting to {self.mirror.conn.name}… ({e})"
                self._retry_at = now + RETRY_S
            except RemoteError as e:  # a refused key, say: nothing more will come
                self.lost = str(e)
        update = self.local.poll()
        if self.mlflow is not None:
            self.mlflow.poll()
        if gone and not self.local.done:
            self.lost = (
                f"its process on {self.mirror.conn.name} (pid {self.mirror.pid}) is gone and wrote no final status"
            )
        return update

    @property
    def done(self) -> bool:
        return self.lost is not None or self.local.done

    def close(self, timeout: float = 60.0) -> bool:
        """At the follow's end: what the mirror still sends to MLflow for the host, at most ``timeout``."""
        return self.mlflow.close(timeout) if self.mlflow is not None else True

    def control(self, command: str) -> None:
        """Pause, resume or stop the run there (through its control file)."""
        write_remote_control(self.mirror.conn, self.mirror.remote_dir, command)


def _mlflow_mirror(local: Path) -> Any:
    """The mirror's MLflow sender (``multilane.integrations.mlflow_logger``), None where that cannot load."""
    try:
        from multilane.integrations.mlflow_logger import MirrorLogger
    except Exception:
        return None
    return MirrorLogger(local)


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.mirror.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    with contextlib.suppress(OSError):
        os.utime(path)
