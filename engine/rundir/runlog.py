"""The run directory: config, environment, metrics.jsonl, status, checkpoints. Crash-safe by design.

- ``metrics.jsonl`` gets one JSON record per line, each written whole (a short write is continued)
  to an O_APPEND file, so a process killed at any moment leaves every complete line parseable. A
  line left torn (by a kill, or a disk that filled up) is ended before the next record is written,
  so it never swallows the record after it; readers skip it and count it.
- ``status.json`` and ``checkpoints/last.pt`` are written to a temporary file, fsynced and renamed
  over the old one: a reader sees the old file or the new one, never half of one. A failed write
  removes its temporary file; one left by a killed process is removed at the next resume.
- A run folder has one writer: ``RunDir`` holds an advisory lock (``filelock``, released by the
  kernel when the process dies, so a SIGKILL leaves none stale) for as long as it is open.

The parts live beside it: the lock in ``run_lock.py``, whole and atomic writes in ``writefile.py``,
the checkpoint file (``torch.save`` / a checked ``torch.load``) in ``checkpoint_file.py``, reading a
run folder in ``runread.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import threading
import time
from pathlib import Path
from typing import Any

import filelock
from multilane.engine.errors import UserError
from multilane.engine.rundir.readfile import read_regular_file, user_path
from multilane.engine.rundir.run_lock import LOCK, lock_run_folder, refuse_if_in_use
from multilane.engine.rundir.runread import (
    CHECKPOINT,
    CONFIG,
    ENVIRONMENT,
    ERROR,
    METRICS,
    STATUS,
    TASK_FILE,
    Metrics,
    iter_metrics,
    load_metrics,
    read_json,
    read_metrics,
    record_problem,
    run_task_name,
)
from multilane.engine.rundir.runs_folder import run_folder_problem
from multilane.engine.rundir.writefile import (
    TEMP_FILE,
    atomic_write_bytes,
    check_writable,
    json_safe,
    name_it,
    remove_quietly,
    write_all,
)

__all__ = [
    "CHECKPOINT",
    "CONFIG",
    "ENVIRONMENT",
    "ERROR",
    "METRICS",
    "SAMPLES",
    "STATUS",
    "TASK_FILE",
    "Metrics",
    "RunDir",
    "iter_metrics",
    "load_metrics",
    "read_json",
    "read_metrics",
    "record_problem",
    "run_task_name",
]

SAMPLES = "samples.txt"
RESERVE = ".reserve"  # disk held back while a run writes, so that a full disk can still be reported
RESERVE_BYTES = 256 << 10
_WRITTEN = (CONFIG, ENVIRONMENT, STATUS, METRICS, ERROR, TASK_FILE)


class RunDir:
    """Writes one run's folder; also used to reopen it for ``--resume``. Holds the folder's lock
    from ``create`` / ``open_existing`` until ``close``."""

    writes = True  # False for a ddp rank's view of the folder that rank 0 writes

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._metrics_fd: int | None = None
        self._fresh_line = False  # the metrics file ends mid-line: start the next record on a new line
        self._lock = threading.Lock()
        self._flock: filelock.FileLock | None = None
        self._made_lock_file = False  # this process made .lock (a refused resume removes it)
        self._lock_before: tuple[bytes, int, int] | None = None  # .lock as found (a refused resume puts it back)

    # -- opening ---------------------------------------------------------------------------------
    @classmethod
    def create(cls, runs_dir: str | Path, name: str) -> RunDir:
        """A new ``<runs_dir>/<timestamp>-<name>/``; never one another run already took."""
        root = user_path(runs_dir, "runs folder")
        check_writable(root)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for i in range(1000):
            path = root / (f"{stamp}-{name}" if i == 0 else f"{stamp}-{name}-{i + 1}")
            try:
                path.mkdir()  # exclusive: two runs started in the same second get two folders
            except FileExistsError:
                continue
            except OSError as e:
                raise UserError(f"runs folder {root}: cannot create a run folder ({e.strerror or e})") from None
            try:
                (path / "checkpoints").mkdir()
            except OSError as e:
                raise UserError(f"run {path}: cannot create its checkpoints folder ({e.strerror or e})") from None
            rd = cls(path)
            rd.acquire()
            return rd
        raise UserError(f"runs folder {root}: too many runs named {name!r} this second")

    @classmethod
    def open_existing(cls, path: str | Path, lock: bool = True, wait_s: float = 0.0, in_use_ok: bool = False) -> RunDir:
        """Reopen a run folder to continue it: checked, locked, and cleared of a killed write's
        temporary files. Raises ``UserError`` (one line) when it cannot be continued.

        ``lock=False`` only checks it: for whoever starts the process that will write it (the CLI,
        the ddp launcher, the app), or a ddp rank other than rank 0 (``in_use_ok``: rank 0 holds the
        lock). A folder another process writes is refused first ("in use by pid N"), before anything
        else is said of it and before anything is written into it."""
        p = user_path(path, "resume")
        try:
            if not p.is_dir():
                raise UserError(f"resume: {run_folder_problem(p)}")
        except ValueError as e:  # an embedded NUL
            raise UserError(f"resume: {path!r} is not a usable path ({e})") from None
        if not in_use_ok:
            refuse_if_in_use(p, wait_s)
        if not (p / CHECKPOINT).is_file():
            raise UserError(f"resume: {p} has no checkpoint ({CHECKPOINT}) to resume from")
        for name in _WRITTEN:
            f = p / name
            if f.is_symlink() or (f.exists() and not f.is_file()):
                what = "a symlink" if f.is_symlink() else "a folder" if f.is_dir() else "not a regular file"
                raise UserError(f"resume: {f} is {what}; a run folder's {name} must be a plain file")
        check_writable(p, "resume: run folder")
        check_writable(p / "checkpoints", "resume: checkpoints folder")
        rd = cls(p)
        if lock:
            rd.acquire(wait_s)
            rd.remove_stale_temp_files()
        return rd

    def acquire(self, wait_s: float = 0.0) -> None:
        """Take the folder's one-writer lock (``RunInUse`` if another process still holds it after
        ``wait_s`` seconds)."""
        self._made_lock_file = not (self.path / LOCK).exists()
        self._lock_before = _lock_file_as_found(self.path / LOCK)
        self._flock = lock_run_folder(self.path, wait_s)

    def close_refused(self) -> None:
        """Close a folder whose resume was refused before it began: leave it as it was found (the
        lock file too, when this process made it)."""
        made = self._flock is not None and self._made_lock_file
        before = self._lock_before if self._flock is not None else None
        self.close()
        if made:
            remove_quietly(self.path / LOCK)
        elif before is not None:  # the lock file as it was: its pid, its time (the pid written is ours)
            _restore_lock_file(self.path / LOCK, *before)

    def remove_stale_temp_files(self) -> list[Path]:
        """Remove temporary files a killed write left (only ever called with the lock held)."""
        removed = []
        for folder in (self.path, self.path / "checkpoints"):
            with contextlib.suppress(OSError):
                for f in folder.iterdir():
                    if (TEMP_FILE.match(f.name) or f.name == RESERVE) and not f.is_dir():
                        remove_quietly(f)
                        removed.append(f)
        return removed

    # -- writing --------------------------------------------------------------------------------
    def write_json(self, name: str, data: dict[str, Any]) -> None:
        atomic_write_bytes(self.path / name, (json.dumps(json_safe(data), indent=2) + "\n").encode())

    def append_metric(self, record: dict[str, Any]) -> None:
        """Append one record; safe from several threads (training and telemetry)."""
        line = (json.dumps(json_safe(record), separators=(",", ":")) + "\n").encode()
        with self._lock:
            if self._metrics_fd is None:
                fd = os.open(self.path / METRICS, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644)
                size = os.fstat(fd).st_size
                self._fresh_line = size > 0 and os.pread(fd, 1, size - 1) != b"\n"
                self._metrics_fd = fd
            if self._fresh_line:
                line = b"\n" + line  # end the torn line first: this record keeps its own line
            try:
                write_all(self._metrics_fd, line)  # one write as a rule: a kill leaves whole lines
            except BaseException as e:
                self._fresh_line = True  # part of the line may be in the file
                if isinstance(e, OSError):
                    name_it(e, self.path / METRICS)
                raise
            self._fresh_line = False

    def set_status(self, state: str, message: str | None = None, **extra: Any) -> None:
        self.write_json(STATUS, {"state": state, "message": message, "updated": time.time(), **extra})

    def append_text(self, name: str, text: str) -> None:
        """Append ``text`` to a text file of the run (one write on an append-only file)."""
        with open(self.path / name, "ab") as f:
            f.write(text.encode("utf-8"))

    def write_error(self, text: str) -> None:
        atomic_write_bytes(self.path / ERROR, text.encode("utf-8", "replace"))

    def save_checkpoint(self, state: dict[str, Any]) -> None:
        """Write ``checkpoints/last.pt`` atomically. On a full disk: ``OSError`` (ENOSPC), the
        temporary file removed, the previous checkpoint untouched."""
        from multilane.engine.rundir.checkpoint_file import save_checkpoint_file  # torch: not for readers

        save_checkpoint_file(self.path / CHECKPOINT, state)

    def reserve_space(self, nbytes: int = RESERVE_BYTES) -> None:
        """Hold ``nbytes`` of disk in a file, freed to record a failure when the disk fills up."""
        with contextlib.suppress(OSError):
            atomic_write_bytes(self.path / RESERVE, b"\0" * nbytes)

    def free_reserve(self) -> None:
        remove_quietly(self.path / RESERVE)

    def remove(self, name: str) -> None:
        """Remove a file of the run folder, if it is there."""
        remove_quietly(self.path / name)

    def close(self) -> None:
        """Close the metrics file, free the reserve, release the folder's lock. Safe to call twice."""
        self.free_reserve()
        with self._lock:
            if self._metrics_fd is not None:
                with contextlib.suppress(OSError):
                    os.close(self._metrics_fd)
                self._metrics_fd = None
        if self._flock is not None:
            with contextlib.suppress(Exception):
                self._flock.release(force=True)
            self._flock = None

    # -- reading --------------------------------------------------------------------------------
    def load_checkpoint(self) -> dict[str, Any]:
        from multilane.engine.rundir.checkpoint_file import load_checkpoint

        return load_checkpoint(self.path / CHECKPOINT)

    def read_json(self, name: str) -> dict[str, Any] | None:
        return read_json(self.path / name)


def _lock_file_as_found(path: Path) -> tuple[bytes, int, int] | None:
    """A lock file's bytes and times (ns) before this process takes the lock, or None."""
    try:
        st = os.stat(path, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode) or st.st_size > 4096:
            return None
        return read_regular_file(path, 4096), st.st_atime_ns, st.st_mtime_ns
    except (OSError, ValueError):
        return None


def _restore_lock_file(path: Path, data: bytes, atime_ns: int, mtime_ns: int) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW)
        try:
            write_all(fd, data)
        finally:
            os.close(fd)
        os.utime(path, ns=(atime_ns, mtime_ns), follow_symlinks=False)
