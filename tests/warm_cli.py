"""The suite's ``multilane`` subprocesses, forked from a server that has imported torch (issue 30).

Every ``python -m multilane.engine.cli ...`` a test (or the app under test, in the test's process)
starts with ``subprocess`` would pay for Python's start, ``import torch`` and ``torch._dynamo`` (the
first optimizer loads it) and pydantic: 2.5 to 5 s of CPU on the 2-core machine, hundreds of times a
run, where the run itself often trains for a fraction of a second. ``WarmPopen`` starts those commands
as a fork of a ``multiprocessing`` forkserver that imported these modules once per pytest worker:
the child gets the test's stdin, stdout and stderr (pipes or files), its working folder, its
environment, its own session when asked, and runs the CLI as ``python -m`` does (``runpy``: exit
status, ``atexit``, an uncaught exception's traceback, death by SIGINT). Its pid is a real process's:
signals, ``psutil`` and process groups reach it; ``poll``/``wait`` read its exit status from the server.

Only where the test's promise does not depend on a cold start: a command with a ``preexec_fn`` (resource
limits) or other unusual arguments runs as a real ``exec``, and so does every command of a test marked
``cold_start`` (Ctrl+C while torch loads, what a command imports). ``MULTILANE_TEST_COLD=1`` turns the
whole suite back to cold starts.
"""

from __future__ import annotations

import atexit
import io
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import threading
from multiprocessing.reduction import DupFd
from typing import Any

import setproctitle

PRELOAD = [
    "torch",
    "torch._dynamo",
    "numpy",
    "pydantic",
    "psutil",
    "rich.console",
    "filelock",
    "setproctitle",
    "multilane.engine.cli.main",
]
CLI_MODULE = "multilane.engine.cli"
_cold = threading.local()


def set_cold(cold: bool) -> None:
    """This thread's commands start cold (a ``cold_start`` test) or warm."""
    _cold.value = cold


def _module_argv(args: Any, executable: Any, kw: dict[str, Any]) -> list[str] | None:
    """``sys.argv`` of the CLI run that ``args`` asks for, or None when it is not one to fork warm."""
    if getattr(_cold, "value", False) or os.environ.get("MULTILANE_TEST_COLD") == "1" or executable is not None:
        return None
    if isinstance(args, (str, bytes)) or kw.get("shell") or kw.get("preexec_fn") is not None:
        return None
    if kw.get("pass_fds") or kw.get("user") is not None or kw.get("group") is not None or kw.get("extra_groups"):
        return None
    if kw.get("umask", -1) != -1 or kw.get("process_group") is not None or kw.get("close_fds") is False:
        return None
    args = [os.fsdecode(a) for a in args]
    if len(args) >= 3 and args[0] == sys.executable and args[1:3] == ["-m", CLI_MODULE]:
        return args
    if args and args[0] == os.path.join(os.path.dirname(sys.executable), "multilane"):
        return args
    return None


class WarmPopen(subprocess.Popen):
    """``subprocess.Popen``; a ``multilane`` command forked from the warm server (see the module)."""

    def __init__(self, args: Any, *a: Any, **kw: Any) -> None:
        executable = a[1] if len(a) > 1 else kw.get("executable")  # Popen(args, bufsize, executable, ...)
        self._warm_argv = _module_argv(args, executable, kw) if len(a) <= 2 else None
        self._warm: Any = None
        super().__init__(args, *a, **kw)

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                       restore_signals, gid, gids, uid, umask, start_new_session, process_group):  # fmt: skip
        if self._warm_argv is None:
            return super()._execute_child(
                args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo, creationflags, shell,
                p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, restore_signals, gid, gids, uid, umask,
                start_new_session, process_group,
            )  # fmt: skip
        try:
            fds = [fd if fd != -1 else std for fd, std in ((p2cread, 0), (c2pwrite, 1), (errwrite, 2))]
            environ = {os.fsdecode(k): os.fsdecode(v) for k, v in (env if env is not None else os.environ).items()}
            where = os.fsdecode(cwd) if cwd is not None else os.getcwd()
            ctx = _context()
            proc = ctx.Process(
                target=_child,
                args=(self._warm_argv, environ, where, bool(start_new_session), [DupFd(fd) for fd in fds]),
                daemon=False,
            )
            proc.start()
            self._warm = proc
            self.pid = proc.pid
            self._child_created = True
        finally:
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)

    def _internal_poll(self, _deadstate: Any = None, **kw: Any) -> int | None:
        if self._warm is None:
            return super()._internal_poll(_deadstate, **kw)
        if self.returncode is None:
            code = self._warm.exitcode
            if code is not None:
                self.returncode = code
        return self.returncode

    def _wait(self, timeout: float | None) -> int:
        if self._warm is None:
            return super()._wait(timeout)
        if self.returncode is None:
            self._warm.join(timeout)
            code = self._warm.exitcode
            if code is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = code
        return self.returncode


_CTX: Any = None


def _context() -> Any:
    global _CTX
    if _CTX is None:
        _CTX = multiprocessing.get_context("forkserver")
        _CTX.set_forkserver_preload(PRELOAD)
    return _CTX


def install() -> None:
    """Every ``subprocess.Popen`` (and so ``subprocess.run``) in this process is a ``WarmPopen``."""
    subprocess.Popen = WarmPopen  # type: ignore[misc]


def _streams(env: dict[str, str]) -> None:
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


def _child(argv: list[str], env: dict[str, str], cwd: str, new_session: bool, fds: list[Any]) -> None:
    """In the forked child: become ``python -m multilane.engine.cli ARGV`` and end as it would."""
    if new_session:
        os.setsid()
    got = [fd.detach() for fd in fds]
    for target, fd in zip((0, 1, 2), got, strict=True):
        os.dup2(fd, target)
    for fd in set(got) - {0, 1, 2}:
        os.close(fd)
    # ps, psutil and a search by command line see the command, not the server's command line
    setproctitle.setproctitle(" ".join(argv))
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    _streams(env)
    multiprocessing.set_start_method(None, force=True)  # the platform's, as in a fresh interpreter
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    sys.argv = ["-m", *argv[3:]] if argv[1:3] == ["-m", CLI_MODULE] else list(argv)
    code: Any = 0
    interrupted = False
    try:
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
