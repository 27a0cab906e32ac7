"""A run folder's one-writer lock: an advisory ``filelock`` on ``.lock``, released by the kernel when
the process dies (a SIGKILL leaves none stale), with the holder's pid written beside it for the
message another process gets."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import filelock
from multilane.engine.errors import UserError
from multilane.engine.readfile import describe_os_error, read_regular_file
from multilane.engine.writefile import write_all

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
        holder = ""
        with contextlib.suppress(OSError, ValueError):
            holder = read_regular_file(lock_path, 64).decode().strip()
        who = f"pid {holder}" if holder.isdigit() else "another process"
        raise RunInUse(f"run {folder} is in use by {who}; one run writes to a folder at a time") from None
    except OSError as e:
        raise UserError(f"run {folder}: cannot lock it ({describe_os_error(e)})") from None
    with contextlib.suppress(OSError):  # who holds it, for the message above (not the lock itself)
        fd = os.open(lock_path, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW)
        try:
            write_all(fd, f"{os.getpid()}\n".encode())
        finally:
            os.close(fd)
    return lock
