"""The parent's side: a ``multiprocessing`` forkserver that imports torch, the engine and their friends
once, and forks each ``multilane`` command from there; a handle on the forked process that answers as
``subprocess.Popen`` does (``pid``, ``poll``, ``wait``, ``returncode``).

The server has imported modules and run nothing: it touched no device (no CUDA context to inherit) and
started no thread, so a forked child computes what a fresh interpreter computes. The server is this
process's ``multiprocessing`` forkserver, started on first use with this process's environment; each child
gets its own environment (``cli_child``). It ends with this process."""

from __future__ import annotations

import atexit
import contextlib
import importlib
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing import connection, forkserver, popen_forkserver, resource_tracker, spawn
from multiprocessing.reduction import DupFd
from typing import Any

import setproctitle
import torch
from multilane.engine.errors import UserError
from multilane.engine.start.cli_child import run_cli

PRELOAD = [
    "torch",
    "torch._dynamo",
    "numpy",
    "pydantic",
    "psutil",
    "filelock",
    "rich.console",
    "setproctitle",
    "multilane.engine.cli.main",
    "multilane.engine.display.progress",
    "multilane.engine.run.trainer",
    "multilane.engine.tasks",
]
"""What the server imports before it forks. No module of the engine reads a setting when it loads (each
reads the environment when it runs), so a child's own environment still decides."""

_LAUNCH = threading.Lock()


WAYS = ("forkserver", "exec")


def start_way(env_name: str) -> str:
    """How to start a kind of process: ``$env_name``, forkserver (the default) or exec (a fresh
    interpreter each time)."""
    chosen = os.environ.get(env_name, "").strip().lower() or WAYS[0]
    if chosen not in WAYS:
        raise UserError(f"{env_name}={os.environ[env_name]!r}: expected forkserver (the default) or exec")
    return chosen


def context(preload: list[str] = PRELOAD) -> Any:
    """This process's forkserver context; ``preload`` counts if the server has not started yet."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(preload)
    return ctx


class _Popen(popen_forkserver.Popen):
    """The server's start of one process, without the import of this process's ``__main__`` that
    ``multiprocessing`` does for its own workers: the child runs the CLI and needs nothing of it, and a
    script with no ``if __name__ == "__main__"`` guard would run again in it."""

    def _launch(self, process_obj: Any) -> None:
        with _LAUNCH:
            prepare = spawn.get_preparation_data

            def without_main(name: str) -> dict[str, Any]:
                data = prepare(name)
                data.pop("init_main_from_path", None)
                data.pop("init_main_from_name", None)
                return data

            spawn.get_preparation_data = without_main
            try:
                super()._launch(process_obj)
            finally:
                spawn.get_preparation_data = prepare


class _Process(multiprocessing.context.ForkServerProcess):
    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        return _Popen(process_obj)


def _native_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1 << 30


_THREADS_OF_IMPORTS = _native_threads()  # with torch loaded: the one idle thread it starts as it loads


def fork_server_here(preload: list[str], title: str) -> bool:
    """Start this process's ``multiprocessing`` forkserver as a fork of this process instead of a fresh
    interpreter that imports ``preload`` again (seconds of CPU); True if it did. Only while this process
    has no thread but the main one and those torch starts as it loads (native ones counted: a fork copies
    no other thread, and no lock one might hold), as a forkserver that imported torch has, and no CUDA
    context (a forked child cannot use it): otherwise the forkserver starts as usual on first use.

    The server is what a fresh one would be: this process's modules, ``preload`` imported, no ``atexit``
    work of this process, default signal handlers; it ends when this process and every process it forked
    have ended, as the usual one does. What this process had open stays open in it (unused), so that no
    descriptor number is ever reused under an object that still names it."""
    server = forkserver._forkserver
    if sys.platform != "linux" or server._forkserver_pid is not None or torch.cuda.is_initialized():
        return False
    for name in preload:
        importlib.import_module(name)
    with server._lock:
        resource_tracker.ensure_running()
        if threading.active_count() != 1 or _native_threads() > _THREADS_OF_IMPORTS:
            return False
        with socket.socket(socket.AF_UNIX) as listener:
            address = connection.arbitrary_address("AF_UNIX")
            listener.bind(address)
            os.chmod(address, 0o600)
            listener.listen()
            alive_r, alive_w = os.pipe()
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            pid = os.fork()
            if pid == 0:
                try:
                    os.close(alive_w)
                    atexit._clear()
                    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
                        signal.signal(sig, signal.SIG_DFL)
                    signal.signal(signal.SIGINT, signal.default_int_handler)
                    setproctitle.setproctitle(title)
                    forkserver.main(listener.fileno(), alive_r, [])
                finally:
                    os._exit(0)
            os.close(alive_r)
        server._forkserver_address = address
        server._forkserver_alive_fd = alive_w
        server._forkserver_pid = pid
    return True


def end_server(timeout_s: float = 10.0) -> None:
    """Ask this process's forkserver to end (its "alive" pipe closed) and wait up to ``timeout_s`` for it,
    so that once this process has ended nothing it started is left: the server would otherwise end a
    moment after it, and a caller that waits for this process alone (a host's launcher followed over
    SSH) could see it still there. The server ends once every process it forked has ended too."""
    server = forkserver._forkserver
    with server._lock:
        pid, alive, address = server._forkserver_pid, server._forkserver_alive_fd, server._forkserver_address
        if pid is None:
            return
        server._forkserver_pid = server._forkserver_alive_fd = server._forkserver_address = None
        os.close(alive)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            break
        if done or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    with contextlib.suppress(OSError, TypeError):
        os.unlink(address)


class _Fd:
    """A descriptor for the child, sent with the process's own start message (``SCM_RIGHTS``): wrapped
    when the process is pickled, as the server's ``Popen`` expects, so no sharing thread is needed."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        return _passed, (DupFd(self.fd),)


def _passed(dup: Any) -> Any:
    return dup


class ForkedProcess:
    """A process forked from the server, answering as ``subprocess.Popen`` does."""

    def __init__(self, args: list[str], process: Any) -> None:
        self.args = args
        self._process = process
        self.pid: int = process.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and self._process.exitcode is not None:
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._process.join(timeout)
            if self._process.exitcode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = self._process.exitcode
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)


def start_cli(
    argv: list[str],
    *,
    stdin: int,
    stdout: int,
    stderr: int,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    new_session: bool = False,
    signal_when_i_end: int | None = None,
) -> ForkedProcess:
    """Fork ``argv`` (a ``multilane`` command line: ``python -m multilane.engine.cli`` then its arguments) from the server, on the
    descriptors ``stdin``, ``stdout``, ``stderr``. ``signal_when_i_end``: the signal the child gets when
    this process ends, however it ends (a pidfd the child watches)."""
    environ = {os.fsdecode(k): os.fsdecode(v) for k, v in (env if env is not None else os.environ).items()}
    where = os.fsdecode(cwd) if cwd is not None else os.getcwd()
    me = os.pidfd_open(os.getpid()) if signal_when_i_end is not None else None
    ready_r, ready_w = os.pipe()
    try:
        context()
        process = _Process(
            target=run_cli,
            args=(
                list(argv),
                environ,
                where,
                new_session,
                [_Fd(fd) for fd in (stdin, stdout, stderr)],
                _Fd(ready_w),
                _Fd(me) if me is not None else None,
                int(signal_when_i_end or signal.SIGTERM),
            ),
            daemon=False,
        )
        process.start()
        os.close(ready_w)
        ready_w = -1
        # back once the child has its session and descriptors (or has died): a signal to its group
        # right after reaches all of it, as after subprocess.Popen
        os.read(ready_r, 1)
    finally:
        for fd in (me, ready_r, ready_w):
            if fd is not None and fd >= 0:
                os.close(fd)
    return ForkedProcess(list(argv), process)
