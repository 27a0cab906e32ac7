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
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import stat
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import filelock
import torch
from multilane.engine.errors import UserError
from multilane.engine.readfile import describe_os_error, kind_of, read_regular_file
from multilane.engine.runread import (
    CHECKPOINT,
    CONFIG,
    ENVIRONMENT,
    ERROR,
    METRICS,
    STATUS,
    TASK_FILE,
    Metrics,
    checkpoint_problem,
    iter_metrics,
    load_metrics,
    read_json,
    read_metrics,
    record_problem,
    run_task_name,
)

__all__ = [
    "CHECKPOINT",
    "CONFIG",
    "ENVIRONMENT",
    "ERROR",
    "LOCK",
    "METRICS",
    "SAMPLES",
    "STATUS",
    "TASK_FILE",
    "Metrics",
    "RunDir",
    "check_writable",
    "iter_metrics",
    "load_checkpoint",
    "load_metrics",
    "read_json",
    "read_metrics",
    "record_problem",
    "run_task_name",
]

LOCK = ".lock"
SAMPLES = "samples.txt"
RESERVE = ".reserve"  # disk held back while a run writes, so that a full disk can still be reported
RESERVE_BYTES = 256 << 10
_TEMP = re.compile(r"^\..+\.\d+\.tmp$")  # what _temp_name makes: .<name>.<pid>.tmp
_WRITTEN = (CONFIG, ENVIRONMENT, STATUS, METRICS, ERROR, TASK_FILE)


def _temp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


def _name_it(e: OSError, path: Path) -> None:
    """A failed write names the file it was for (``os.write`` and ``file.write`` name none)."""
    if e.filename is None:
        e.filename = str(path)


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = _temp_name(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        try:
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as e:
        _remove(tmp)  # a full disk must not stay full of our temporary files
        if isinstance(e, OSError):
            _name_it(e, path)
        raise


def _write_all(fd: int, data: bytes) -> None:
    """``os.write`` until every byte is written: a write may take fewer bytes than it was given."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _json_safe(value: Any) -> Any:
    """NaN and inf become null: strict JSON readers (browsers, jq) must parse every line."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def check_writable(folder: Path, what: str = "runs folder") -> None:
    """Refuse early, with a clear line, a folder that cannot be created or written (4 KiB probe).

    The probe is a fresh temporary file (O_EXCL | O_NOFOLLOW, by ``tempfile``): a symlink planted in
    the folder is never followed, and the probe never writes into an existing file.
    """
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"{what} {folder}: not writable (cannot create it: {describe_os_error(e)})") from None
    except ValueError as e:  # an embedded NUL
        raise UserError(f"{what} {folder!r}: not a usable path ({e})") from None
    if not folder.is_dir():
        raise UserError(f"{what} {folder}: not a folder")
    probe = None
    try:
        fd, name = tempfile.mkstemp(prefix=".multilane-write-test-", dir=folder)
        probe = Path(name)
        try:
            _write_all(fd, b"x" * 4096)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        reason = describe_os_error(e)
        if isinstance(e, FileNotFoundError):  # /proc and the like: the folder is there, files cannot be
            reason = "this file system does not take new files"
        raise UserError(f"{what} {folder}: not writable ({reason})") from None
    finally:
        if probe is not None:
            _remove(probe)


class _KeepWriteError:
    """A file for ``torch.save`` that keeps the ``OSError`` of a failed write (torch replaces it)."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self._f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        try:
            self._f.flush()
        except OSError as e:
            self.error = e
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


class RunInUse(UserError):
    """Another process (or another run in this one) holds the run folder's lock."""


class RunDir:
    """Writes one run's folder; also used to reopen it for ``--resume``. Holds the folder's lock
    from ``create`` / ``open_existing`` until ``close``."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._metrics_fd: int | None = None
        self._fresh_line = False  # the metrics file ends mid-line: start the next record on a new line
        self._lock = threading.Lock()
        self._flock: filelock.FileLock | None = None

    # -- opening ---------------------------------------------------------------------------------
    @classmethod
    def create(cls, runs_dir: str | Path, name: str) -> RunDir:
        """A new ``<runs_dir>/<timestamp>-<name>/``; never one another run already took."""
        root = Path(runs_dir).expanduser()
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
    def open_existing(cls, path: str | Path, lock: bool = True, wait_s: float = 0.0) -> RunDir:
        """Reopen a run folder to continue it: checked, locked, and cleared of a killed write's
        temporary files. Raises ``UserError`` (one line) when it cannot be continued.

        ``lock=False`` only checks it: for a reader, or a ddp rank other than rank 0 (rank 0 writes)."""
        p = Path(path).expanduser()
        try:
            if not p.is_dir():
                raise UserError(f"resume: {p} is not a run folder")
        except ValueError as e:  # an embedded NUL
            raise UserError(f"resume: {path!r} is not a usable path ({e})") from None
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
        lock_path = self.path / LOCK
        lock = filelock.FileLock(lock_path, timeout=wait_s, thread_local=False)
        try:
            lock.acquire()
        except filelock.Timeout:
            holder = ""
            with contextlib.suppress(OSError, ValueError):
                holder = read_regular_file(lock_path, 64).decode().strip()
            who = f"pid {holder}" if holder.isdigit() else "another process"
            raise RunInUse(f"run {self.path} is in use by {who}; one run writes to a folder at a time") from None
        except OSError as e:
            raise UserError(f"run {self.path}: cannot lock it ({describe_os_error(e)})") from None
        self._flock = lock
        with contextlib.suppress(OSError):  # who holds it, for the message above (not the lock itself)
            fd = os.open(lock_path, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW)
            try:
                _write_all(fd, f"{os.getpid()}\n".encode())
            finally:
                os.close(fd)

    def remove_stale_temp_files(self) -> list[Path]:
        """Remove temporary files a killed write left (only ever called with the lock held)."""
        removed = []
        for folder in (self.path, self.path / "checkpoints"):
            with contextlib.suppress(OSError):
                for f in folder.iterdir():
                    if (_TEMP.match(f.name) or f.name == RESERVE) and not f.is_dir():
                        _remove(f)
                        removed.append(f)
        return removed

    # -- writing --------------------------------------------------------------------------------
    def write_json(self, name: str, data: dict[str, Any]) -> None:
        _atomic_write_bytes(self.path / name, (json.dumps(_json_safe(data), indent=2) + "\n").encode())

    def append_metric(self, record: dict[str, Any]) -> None:
        """Append one record; safe from several threads (training and telemetry)."""
        line = (json.dumps(_json_safe(record), separators=(",", ":")) + "\n").encode()
        with self._lock:
            if self._metrics_fd is None:
                fd = os.open(self.path / METRICS, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644)
                size = os.fstat(fd).st_size
                self._fresh_line = size > 0 and os.pread(fd, 1, size - 1) != b"\n"
                self._metrics_fd = fd
            if self._fresh_line:
                line = b"\n" + line  # end the torn line first: this record keeps its own line
            try:
                _write_all(self._metrics_fd, line)  # one write as a rule: a kill leaves whole lines
            except BaseException as e:
                self._fresh_line = True  # part of the line may be in the file
                if isinstance(e, OSError):
                    _name_it(e, self.path / METRICS)
                raise
            self._fresh_line = False

    def set_status(self, state: str, message: str | None = None, **extra: Any) -> None:
        self.write_json(STATUS, {"state": state, "message": message, "updated": time.time(), **extra})

    def append_text(self, name: str, text: str) -> None:
        """Append ``text`` to a text file of the run (one write on an append-only file)."""
        with open(self.path / name, "ab") as f:
            f.write(text.encode("utf-8"))

    def write_error(self, text: str) -> None:
        _atomic_write_bytes(self.path / ERROR, text.encode("utf-8", "replace"))

    def save_checkpoint(self, state: dict[str, Any]) -> None:
        """Write ``checkpoints/last.pt`` atomically. On a full disk: ``OSError`` (ENOSPC), the
        temporary file removed, the previous checkpoint untouched."""
        target = self.path / CHECKPOINT
        target.parent.mkdir(exist_ok=True)
        tmp = _temp_name(target)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "wb") as f:
                out = _KeepWriteError(f)
                try:
                    torch.save(state, out)
                except RuntimeError:
                    # torch reports a failed write as "unexpected pos ..."; the OSError says why.
                    if out.error is not None:
                        raise out.error from None
                    raise
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException as e:
            _remove(tmp)  # the previous checkpoint stays; the disk gets its space back
            if isinstance(e, OSError):
                _name_it(e, target)
            raise

    def reserve_space(self, nbytes: int = RESERVE_BYTES) -> None:
        """Hold ``nbytes`` of disk in a file, freed to record a failure when the disk fills up."""
        with contextlib.suppress(OSError):
            _atomic_write_bytes(self.path / RESERVE, b"\0" * nbytes)

    def free_reserve(self) -> None:
        _remove(self.path / RESERVE)

    def remove(self, name: str) -> None:
        """Remove a file of the run folder, if it is there."""
        _remove(self.path / name)

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
        return load_checkpoint(self.path / CHECKPOINT)

    def read_json(self, name: str) -> dict[str, Any] | None:
        return read_json(self.path / name)


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """A checkpoint's contents, loaded with ``weights_only=True`` (no pickle runs), checked for the
    fields a resume needs; ``UserError`` with one line otherwise."""
    try:
        st = os.stat(path)
    except (OSError, ValueError) as e:
        reason = describe_os_error(e) if isinstance(e, OSError) else str(e)
        raise UserError(f"checkpoint {path}: cannot read it ({reason})") from None
    if not stat.S_ISREG(st.st_mode):
        raise UserError(f"checkpoint {path}: is {kind_of(st.st_mode)}, not a file")
    try:
        with warnings.catch_warnings():  # torch warns (several lines) about odd pickle protocols in junk
            warnings.simplefilter("ignore")
            ck = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise UserError(f"checkpoint {path}: cannot load it ({_torch_load_reason(e)})") from None
    problem = checkpoint_problem(ck)
    if problem:
        raise UserError(f"checkpoint {path}: not a Multilane checkpoint ({problem})")
    return ck


def _torch_load_reason(e: BaseException) -> str:
    """One short reason, without torch's advice to load with ``weights_only=False`` (that would run
    whatever code the file holds)."""
    text = str(e)
    if "WeightsUnpickler error:" in text:
        detail = text.split("WeightsUnpickler error:", 1)[1].strip().splitlines()[0].strip()
        detail = detail.split(" Please use")[0].rstrip(". ")
        return f"it holds something other than tensors and plain data: {detail}"[:200]
    if isinstance(e, EOFError):
        return "the file ends early"
    if isinstance(e, (KeyError, UnicodeDecodeError)) or "invalid load key" in text:
        return "not a torch checkpoint"
    head = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    if "weights_only" in head:
        return "not a checkpoint it can load safely"
    return f"{type(e).__name__}: {head}"[:200] if head else type(e).__name__
