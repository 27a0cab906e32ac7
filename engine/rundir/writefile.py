"""Writing files that a kill or a full disk must not leave half-written: whole writes, atomic
replaces (temporary file, fsync, rename), and an early check that a folder takes new files."""

from __future__ import annotations

import contextlib
import math
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from multilane.engine.errors import UserError
from multilane.engine.rundir.readfile import describe_os_error

MIN_FREE_BYTES = 1 << 20
"""Below this much free space a run is refused up front: with ~36 KB free the 4 KiB probe passed, the
256 KiB reserve failed silently, and at step 37 the outcome could not be written (status.json stayed
"running"). 1 MiB holds the reserve, the status and the first records."""

TEMP_FILE = re.compile(r"^\..+\.\d+\.tmp$")  # what temp_name makes: .<name>.<pid>.tmp


def temp_name(path: Path) -> Path:
    """The temporary file an atomic write of ``path`` goes through (this process's own)."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def remove_quietly(path: Path) -> None:
    """Remove ``path`` if it is there; a failure is not an error (cleaning up after one)."""
    with contextlib.suppress(OSError):
        path.unlink()


def name_it(e: OSError, path: Path) -> None:
    """A failed write names the file it was for (``os.write`` and ``file.write`` name none)."""
    if e.filename is None:
        e.filename = str(path)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data``: a reader sees the old file or the new one, never half of one."""
    tmp = temp_name(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        try:
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as e:
        remove_quietly(tmp)  # a full disk must not stay full of our temporary files
        if isinstance(e, OSError):
            name_it(e, path)
        raise


def write_all(fd: int, data: bytes) -> None:
    """``os.write`` until every byte is written: a write may take fewer bytes than it was given."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def json_safe(value: Any) -> Any:
    """NaN and inf become null: strict JSON readers (browsers, jq) must parse every line."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def check_writable(folder: Path, what: str = "runs folder", create: bool = True) -> None:
    """Refuse early, with a clear line, a folder that cannot be created or written (4 KiB probe).

    The probe is a fresh temporary file (O_EXCL | O_NOFOLLOW, by ``tempfile``): a symlink planted in
    the folder is never followed, and the probe never writes into an existing file. ``create=False``
    (a check before a run's set-up, which may still be interrupted) makes nothing: a folder that is
    not there yet is judged by the nearest folder above it that is, where it would be created.
    """
    probe_dir = folder
    if not create:
        try:
            target = folder
            while not target.exists() and target != target.parent:
                target = target.parent
        except ValueError as e:  # an embedded NUL
            raise UserError(f"{what} {folder!r}: not a usable path ({e})") from None
        except OSError as e:  # a name too long, a folder that cannot be searched
            raise UserError(f"{what} {folder}: not writable ({describe_os_error(e)})") from None
        if target != folder:
            if not target.is_dir():
                raise UserError(f"{what} {folder}: not writable (cannot create it: {target} is not a folder)")
            probe_dir = target
    try:
        probe_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"{what} {folder}: not writable (cannot create it: {describe_os_error(e)})") from None
    except ValueError as e:  # an embedded NUL
        raise UserError(f"{what} {folder!r}: not a usable path ({e})") from None
    if not probe_dir.is_dir():
        raise UserError(f"{what} {folder}: not a folder")
    probe = None
    try:
        fd, name = tempfile.mkstemp(prefix=".multilane-write-test-", dir=probe_dir)
        probe = Path(name)
        try:
            write_all(fd, b"x" * 4096)
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
            remove_quietly(probe)
    try:
        st = os.statvfs(probe_dir)
    except OSError:
        return
    free = st.f_bavail * st.f_frsize
    if free < MIN_FREE_BYTES:
        raise UserError(
            f"{what} {folder}: only {free / 1024:,.0f} KiB free; a run needs at least "
            f"{MIN_FREE_BYTES >> 20} MiB to record its state (status, metrics, the reserve that lets a full "
            "disk be reported); free some space"
        )
