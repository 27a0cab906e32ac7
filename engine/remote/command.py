"""One command on a host, bounded: an overall deadline, a cap on what it may answer, and a kill of its
whole process group there when it passes either.

sshd starts each command's shell as a session leader (OpenSSH's ``do_exec_no_pty`` calls ``setsid``), so
the shell's pid is the process group of everything the command starts (a detached run, started with
``setsid``, leaves it on purpose). The command first names that pid on its standard error, behind a
marker; the deadline or the cap then kills the group with a second command (``kill -KILL -- -PGID``),
and the one line says what happened ("timed out after 60 s", "answered more than 16 MB"), never "the
connection dropped". What arrives is read in chunks into a buffer no larger than the cap.

``MULTILANE_REMOTE_TIMEOUT`` (seconds) and ``MULTILANE_REMOTE_MAX_MB`` change the defaults (60 s, 16 MB).
"""

from __future__ import annotations

import os
import re
import select
import shlex
import time
from dataclasses import dataclass
from typing import Any

COMMAND_TIMEOUT_S = 60.0
MAX_OUTPUT_BYTES = 16 << 20
CHUNK = 1 << 16
MARKER_WAIT_S = 2.0  # how long an overrun waits for the process-group line (_marker)
_PGID = re.compile(rb"\x1emultilane-pgid (\d+)\n")


def default_timeout_s() -> float:
    """The deadline of one command: ``MULTILANE_REMOTE_TIMEOUT`` seconds, else 60."""
    try:
        value = float(os.environ.get("MULTILANE_REMOTE_TIMEOUT", ""))
    except ValueError:
        return COMMAND_TIMEOUT_S
    return value if value > 0 else COMMAND_TIMEOUT_S


def default_max_bytes() -> int:
    """The cap on one command's answer: ``MULTILANE_REMOTE_MAX_MB`` megabytes, else 16."""
    try:
        value = float(os.environ.get("MULTILANE_REMOTE_MAX_MB", ""))
    except ValueError:
        return MAX_OUTPUT_BYTES
    return int(value * (1 << 20)) if value > 0 else MAX_OUTPUT_BYTES


def size_text(n: int) -> str:
    mb = n / (1 << 20)
    return f"{mb:g} MB" if mb >= 1 else f"{n:,} bytes"


def wrapped(command: str, login: bool) -> str:
    """The line sent: names its process group on stderr, then becomes ``command`` (through ``sh -l`` when
    ``login``). Single quotes and ``exec`` read the same in sh, bash, zsh, csh and fish."""
    inner = f'printf "\\036multilane-pgid %s\\n" "$$" >&2; exec sh {"-lc" if login else "-c"} "$1"'
    return f"exec sh -c {shlex.quote(inner)} multilane {shlex.quote(command)}"


@dataclass
class Answer:
    code: int
    stdout: bytes
    stderr: bytes
    pgid: int | None


class Overrun(Exception):
    """The command passed its deadline or its cap: ``reason`` says which, in words."""

    def __init__(self, reason: str, pgid: int | None) -> None:
        super().__init__(reason)
        self.reason, self.pgid = reason, pgid


def read_bounded(chan: Any, timeout_s: float, max_bytes: int) -> Answer:
    """Everything the command on ``chan`` answers until it ends; ``Overrun`` past the deadline or the cap
    (the caller kills the group). ``OSError``/``EOFError`` when the connection goes."""
    deadline = time.monotonic() + timeout_s
    out, err = bytearray(), bytearray()
    pgid: int | None = None
    fd = chan.fileno()
    while True:
        got = False
        # stderr first: the wrapper's process-group line goes there before the command starts, and a
        # flood on stdout must not pass the cap before that line is read (then nothing could be killed)
        while chan.recv_stderr_ready():
            err += chan.recv_stderr(CHUNK)
            got = True
            if pgid is None:
                pgid = _pgid(err)
            if len(out) + len(err) > max_bytes:
                raise Overrun(f"answered more than {size_text(max_bytes)}", pgid or _pgid(err))
        while chan.recv_ready():
            out += chan.recv(CHUNK)
            got = True
            if len(out) + len(err) > max_bytes:
                raise Overrun(f"answered more than {size_text(max_bytes)}", pgid or _marker(chan, err))
        if not got and (chan.eof_received or chan.closed) and not (chan.recv_ready() or chan.recv_stderr_ready()):
            break
        left = deadline - time.monotonic()
        if left <= 0:
            raise Overrun(f"timed out after {timeout_s:g} s", pgid or _pgid(err))
        transport = chan.get_transport()
        if transport is None or not transport.is_active():
            raise EOFError("the transport closed")
        if not got:
            select.select([fd], [], [], min(left, 0.5))
    while not chan.exit_status_ready():  # the exit status follows the end of output at once
        left = deadline - time.monotonic()
        if left <= 0:
            raise Overrun(f"timed out after {timeout_s:g} s", pgid or _pgid(err))
        if chan.closed:
            break
        time.sleep(min(left, 0.02))
    code = chan.recv_exit_status() if chan.exit_status_ready() else -1
    if pgid is None:
        pgid = _pgid(err)
    return Answer(code, bytes(out), bytes(_without_marker(err)), pgid)


def _marker(chan: Any, err: bytearray, wait_s: float = MARKER_WAIT_S) -> int | None:
    """The process group from stderr, waiting up to ``wait_s`` for its line: the two streams travel
    apart, so stdout's bytes can arrive before the line printed ahead of them."""
    deadline = time.monotonic() + wait_s
    while (pgid := _pgid(err)) is None and time.monotonic() < deadline and not chan.closed:
        if chan.recv_stderr_ready():
            err += chan.recv_stderr(CHUNK)
        else:
            time.sleep(0.01)
    return pgid


def _pgid(err: bytearray | bytes) -> int | None:
    m = _PGID.search(err, 0, 1 << 16)  # it comes first (after what a login script may print)
    return int(m[1]) if m else None


def _without_marker(err: bytearray) -> bytes:
    m = _PGID.search(err, 0, 1 << 16)
    return bytes(err[: m.start()] + err[m.end() :]) if m else bytes(err)


def kill_group_line(pgid: int) -> str:
    """The line that ends a command's process group there (it may be gone already: true)."""
    return f"kill -KILL -- -{int(pgid)} 2>/dev/null; true"
