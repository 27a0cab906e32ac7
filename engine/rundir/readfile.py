"""Reading a file the user named without hanging or exhausting memory on what it turns out to be; and
turning the path the user typed into one the system takes (``user_path``), or one line saying why not.

A path can name a FIFO (a read blocks forever), ``/dev/zero`` (a read never ends), a folder, or a
file far larger than any config. ``read_regular_file`` opens without blocking, checks that it holds
a regular file and reads at most ``limit`` bytes.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from multilane.engine.errors import UserError

NAME_MAX = 255  # bytes in one file name (ext4, xfs, btrfs, tmpfs; NAME_MAX on Linux and macOS)
PATH_MAX = 4096  # bytes in a whole path (PATH_MAX on Linux)


class NotRegularFile(OSError):
    """The path is a folder, a FIFO, a device or a socket."""


class TooLarge(OSError):
    """The file is larger than the reader accepts."""


def kind_of(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def read_regular_file(path: str | Path, limit: int | None = None) -> bytes:
    """The bytes of a regular file; ``NotRegularFile`` / ``TooLarge`` / ``OSError`` otherwise."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO opens at once instead of waiting for a writer
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(f"{kind_of(st.st_mode)}, not a file")
        if limit is not None and st.st_size > limit:
            raise TooLarge(f"{st.st_size:,} bytes; the limit is {limit:,}")
        chunks = []
        left = st.st_size if limit is None else limit + 1
        while True:
            chunk = os.read(fd, min(1 << 20, left) if limit is not None else 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
            if limit is not None:
                left -= len(chunk)
                if left <= 0:
                    raise TooLarge(f"more than {limit:,} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)


def describe_os_error(e: OSError) -> str:
    """A short reason: the strerror for system errors, the message for ours."""
    if isinstance(e, (NotRegularFile, TooLarge)):
        return str(e)
    return e.strerror or str(e)


def user_path(text: str | os.PathLike[str], what: str) -> Path:
    """The path the user gave for ``what`` (a flag, a config key), ``~`` and ``~user`` expanded; or
    ``UserError`` in one line naming ``what`` where no system call could take it: a NUL byte, a
    ``~user`` that is no user here, a name over 255 bytes, a path over 4,096 bytes, text that is not
    a file name in this system's encoding. Nothing is asked of the file system."""
    s = os.fspath(text)
    if "\0" in s:
        raise UserError(f"{what}: not a usable path (it holds a NUL character)")
    try:
        p = Path(s).expanduser()
    except RuntimeError:  # "Could not determine home directory."
        user = s[1:].split(os.sep, 1)[0]
        raise UserError(f"{what}: {s}: there is no user {user!r} on this machine, so ~{user} is no folder") from None
    try:
        parts = [os.fsencode(part) for part in p.parts]
    except UnicodeEncodeError:
        raise UserError(f"{what}: {s!r} is not a file name this system can store") from None
    for part in parts:
        if len(part) > NAME_MAX:
            shown = os.fsdecode(part[:40])
            raise UserError(
                f"{what}: a name in the path is {len(part):,} bytes long ({shown}…); "
                f"a file or folder name holds at most {NAME_MAX} bytes"
            )
    size = len(os.fsencode(str(p)))
    if size >= PATH_MAX:
        raise UserError(f"{what}: the path is {size:,} bytes long; a path holds at most {PATH_MAX - 1:,} bytes")
    return p
