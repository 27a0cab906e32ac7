"""Reading a run folder's files on a host for the mirror: regular files only, never through a link.

SFTP has no ``O_NOFOLLOW``, so a file is read only when ``lstat`` (which follows nothing) says it is a
regular file, the opened handle's own ``fstat`` agrees (type, owner, mode), and ``lstat`` says so again
after the read: a link, FIFO, device, socket or folder in a file's place is skipped (a FIFO is never
opened: opening one blocks until a writer comes). A file replaced by a link between the two checks and
back again would pass; only someone on the host who can write the run folder can do that.

Whole-file copies have a cap; a growing file is read in chunks of bounded size (``readv``: the chunk's
32 KB requests pipelined, nothing more held).
"""

from __future__ import annotations

import stat
from typing import Any

KINDS = (
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a device"),
    (stat.S_ISBLK, "a device"),
    (stat.S_ISSOCK, "a socket"),
)


class NotAFile(Exception):
    """What is in a file's place, in words ("a symbolic link")."""


def kind_of(mode: int) -> str:
    for test, words in KINDS:
        if test(mode):
            return words
    return "not a regular file"


def lstat_regular(sftp: Any, path: str) -> Any | None:
    """``path``'s attributes when it is a regular file; None when there is nothing; ``NotAFile`` else."""
    try:
        st = sftp.lstat(path)
    except FileNotFoundError:
        return None
    mode = int(st.st_mode or 0)
    if not stat.S_ISREG(mode):
        raise NotAFile(kind_of(mode))
    return st


def _same(a: Any, b: Any) -> bool:
    return (a.st_mode, a.st_uid, a.st_gid) == (b.st_mode, b.st_uid, b.st_gid)


def open_checked(sftp: Any, path: str, seen: Any) -> Any:
    """``path`` opened for reading, its handle checked to be the regular file ``lstat`` saw."""
    f = sftp.open(path, "rb")
    try:
        st = f.stat()
        if not stat.S_ISREG(int(st.st_mode or 0)) or not _same(st, seen):
            raise NotAFile("replaced while it was read")
    except BaseException:
        f.close()
        raise
    return f


def still_regular(sftp: Any, path: str, seen: Any) -> None:
    """After a read: the path is still the regular file it was (``NotAFile`` when a link took its place)."""
    try:
        now = sftp.lstat(path)
    except FileNotFoundError:
        return  # removed meanwhile: what was read came from the file itself
    if not stat.S_ISREG(int(now.st_mode or 0)) or not _same(now, seen):
        raise NotAFile("replaced while it was read")


def read_range(f: Any, offset: int, length: int) -> bytes:
    """``length`` bytes at ``offset`` (fewer at the end of the file), requests pipelined."""
    if length <= 0:
        return b""
    return b"".join(f.readv([(offset, length)]))
