"""A run folder's one-writer lock: an advisory ``filelock`` on ``.lock``, released by the kernel when
the process dies (a SIGKILL leaves none stale), with the holder's pid and host written in it for the
message another process gets, and for a follower to tell a writer that is gone (``writer_gone``)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import time
from pathlib import Path

import filelock
import psutil
from multilane.engine.errors import UserError
from multilane.engine.rundir.readfile import describe_os_error, read_regular_file
from multilane.engine.rundir.writefile import write_all

LOCK = ".lock"


class RunInUse(UserError):
    """Another process (or another run in this one) holds the run folder's lock."""


def lock_run_folder(folder: Path, wait_s: float = 0.0) -> filelock.FileLock:
    """Take ``folder``'s one-writer lock (``RunInUse`` if another process still holds it after
    ``wait_s`` seconds); the caller releases it."""
    lock_path = folder / LOCK
    lock = filelock.FileLock(lock_path, timeout=wait_s, thread_local=False)
    try:
        lock.acquire()
    except filelock.Timeout:
        raise in_use(folder) from None
    except OSError as e:
        raise UserError(f"run {folder}: cannot lock it ({describe_os_error(e)})") from None
    with contextlib.suppress(OSError):  # who holds it, for the message above (not the lock itself)
        fd = os.open(lock_path, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW)
        try:
            write_all(fd, f"{os.getpid()}\n{socket.gethostname()}\n".encode())
        finally:
            os.close(fd)
    return lock


def in_use(folder: Path) -> RunInUse:
    """The error for a folder whose lock another process holds, naming that process."""
    holder = ""
    with contextlib.suppress(OSError, ValueError):
        holder = read_regular_file(folder / LOCK, 64).decode().strip()
    pid, host = holder_of(holder)
    who = f"pid {pid}" + (f" on {host}" if host and host != socket.gethostname() else "") if pid else "another process"
    return RunInUse(f"run {folder} is in use by {who}; one run writes to a folder at a time")


def lock_is_held(folder: Path) -> bool:
    """Whether another process holds ``folder``'s lock now, asked without creating or writing anything
    (a refused resume must leave the folder as it found it). False when there is no lock file."""
    try:
        fd = os.open(folder / LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except (OSError, ValueError):
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what filelock takes: a holder makes this fail
    except OSError as e:
        return e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
    finally:
        os.close(fd)  # closing drops the probe's own lock at once
    return False


def refuse_if_in_use(folder: Path, wait_s: float = 0.0) -> None:
    """``RunInUse`` when another process holds ``folder``'s lock (after waiting up to ``wait_s``)."""
    end = time.monotonic() + wait_s
    while lock_is_held(folder):
        if time.monotonic() >= end:
            raise in_use(folder)
        time.sleep(0.1)


def holder_of(text: str) -> tuple[int | None, str | None]:
    """(pid, host) from a lock file's text ("PID\nHOST\n"; older runs wrote the pid alone)."""
    parts = text.split()
    pid = int(parts[0]) if parts and parts[0].isdigit() and len(parts[0]) < 10 else None
    return pid, (parts[1] if len(parts) > 1 else None)


def writer_gone(folder: Path, status_written: bool = False) -> str | None:
    """Why the process that last took ``folder``'s lock is known to be gone, or None when it may live:
    only a writer on this machine can be checked (a cluster job's folder on a shared filesystem
    cannot, and is never called gone).

    The lock itself is asked, not only the pid in it (a pid is reused by unrelated processes): once
    the run has written a status, a lock nobody holds means its writer ended without a final one.
    Before that (a run still setting up: the app made the folder, its child has not locked it yet)
    only a pid that no longer exists says so."""
    try:
        text = read_regular_file(folder / LOCK, 256).decode("utf-8", "replace")
    except FileNotFoundError:
        text = ""
    except (OSError, ValueError):
        return None
    pid, host = holder_of(text)
    if host is not None and host != socket.gethostname():
        return None
    if status_written and not lock_is_held(folder):
        who = f"its process (pid {pid})" if pid is not None else "its writer"
        return (
            f"{who} no longer holds the run's lock and wrote no final status: it was killed, or its machine lost power"
        )
    if pid is None or host is None or psutil.pid_exists(pid):
        return None
    return f"its process (pid {pid}) is gone and wrote no final status: it was killed, or its machine lost power"
