"""What runs in a process forked from the server: ``python -m multilane.engine.cli ARGV`` (or the
``multilane`` script, or ``python SCRIPT.py ARGV``) as a fresh interpreter would run it, with the standard streams, working folder and environment it was given.

The same exit status (``SystemExit``'s code, 1 and a traceback for an uncaught exception, death by SIGINT
for an uncaught ``KeyboardInterrupt``), non-daemon threads joined and ``atexit`` run before it ends,
stdin/stdout/stderr made again on descriptors 0, 1 and 2 from the environment (``PYTHONUNBUFFERED``,
``PYTHONIOENCODING``), the signal handlers a fresh interpreter starts with, the platform's
``multiprocessing`` start method, and its command line as its process title (ps and psutil show it).
What a fresh interpreter reads from the environment only as torch loads is applied here:
``OMP_NUM_THREADS``, torch's intra-op threads (the server loaded torch with its own environment)."""

from __future__ import annotations

import atexit
import io
import multiprocessing
import os
import runpy
import signal
import sys
import threading
from typing import Any

import setproctitle
from multilane.engine.start.parent_death import signal_when_gone

CLI_MODULE = "multilane.engine.cli"


def streams(env: dict[str, str]) -> None:
    """stdin, stdout and stderr made again on descriptors 0, 1, 2, as a starting interpreter makes them."""
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    encoding = (env.get("PYTHONIOENCODING") or "utf-8").split(":")[0] or "utf-8"

    def text(fd: int, mode: str, errors: str) -> io.TextIOWrapper:
        raw = io.FileIO(fd, mode, closefd=False)
        tty = raw.isatty()
        buffered = io.BufferedReader(raw) if mode == "r" else io.BufferedWriter(raw)
        return io.TextIOWrapper(
            buffered,
            encoding=encoding,
            errors=errors,
            line_buffering=tty or fd == 2,
            write_through=unbuffered and mode == "w",
        )

    sys.stdin = sys.__stdin__ = text(0, "r", "strict")
    sys.stdout = sys.__stdout__ = text(1, "w", "strict")
    sys.stderr = sys.__stderr__ = text(2, "w", "backslashreplace")


def torch_threads(env: dict[str, str]) -> None:
    """torch's intra-op threads from ``OMP_NUM_THREADS``, as torch reads it when it loads."""
    torch = sys.modules.get("torch")
    try:
        n = int(env.get("OMP_NUM_THREADS", ""))
    except ValueError:
        return
    if torch is not None and n > 0:
        torch.set_num_threads(n)


def run_cli(
    argv: list[str],
    env: dict[str, str],
    cwd: str,
    new_session: bool,
    fds: list[Any],
    ready: Any,
    parent: Any = None,
    parent_signal: int = signal.SIGTERM,
) -> None:
    """In the forked child: become ``python -m multilane.engine.cli`` with ``argv`` (the command line,
    interpreter first) and end as it would. ``fds``: stdin, stdout, stderr (``DupFd``s); ``ready``: a pipe
    closed once the session and descriptors are in place (the parent waits for it). ``parent``: a
    pidfd (``DupFd``) of the process whose end sends this one ``parent_signal``."""
    if new_session:
        os.setsid()
    got = [fd.detach() for fd in fds]
    for target, fd in zip((0, 1, 2), got, strict=True):
        os.dup2(fd, target)
    for fd in set(got) - {0, 1, 2}:
        os.close(fd)
    os.close(ready.detach())
    setproctitle.setproctitle(" ".join(argv))
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    streams(env)
    torch_threads(env)
    multiprocessing.set_start_method(None, force=True)  # the platform's, as in a fresh interpreter
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    if parent is not None:
        signal_when_gone(parent.detach(), parent_signal)
    script = argv[1] if len(argv) > 1 and argv[1].endswith(".py") else None
    if argv[1:3] == ["-m", CLI_MODULE]:
        sys.argv = ["-m", *argv[3:]]
    elif script:  # python SCRIPT ARGS: the script's folder first on the path, as Python puts it
        sys.argv = argv[1:]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
    else:  # the ``multilane`` console script
        sys.argv = list(argv)
    code: Any = 0
    interrupted = False
    try:
        if script:
            runpy.run_path(script, run_name="__main__")
        else:
            runpy.run_module(CLI_MODULE, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        interrupted = True
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    for t in threading.enumerate():  # as the interpreter's exit: non-daemon threads first, then atexit
        if t is not threading.current_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            code = code or 120
    if interrupted:  # CPython ends an uncaught KeyboardInterrupt by dying of SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xFF)
