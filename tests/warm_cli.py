"""The suite's ``multilane`` subprocesses, forked from a server that has imported torch.

Every ``python -m multilane.engine.cli ...`` (and ``python SCRIPT.py`` of tests/ and bench/: the
Lightning and Transformers scripts, gpu_check's per-check children) a test (or the app under test, in the
test's process) starts with ``subprocess`` would pay for Python's start, ``import torch`` and ``torch._dynamo`` (the
first optimizer loads it) and pydantic: 2.5 to 5 s of CPU on the 2-core machine, hundreds of times a
run, where the run itself often trains for a fraction of a second. ``WarmPopen`` starts those commands
as a fork of a ``multiprocessing`` forkserver that imported these modules once per pytest worker:
the child gets the test's stdin, stdout and stderr (pipes or files), its working folder, its
environment, its own session when asked, and runs the CLI as ``python -m`` does (``runpy``: exit
status, ``atexit``, an uncaught exception's traceback, death by SIGINT). Its pid is a real process's:
signals, ``psutil`` and process groups reach it; ``poll``/``wait`` read its exit status from the server.
The server and the child are the product's own (``multilane.engine.start``: sweep trials start the same
way); this module only decides which of the suite's commands go there.

Only where the test's promise does not depend on a cold start: a command with a ``preexec_fn`` (resource
limits) or other unusual arguments runs as a real ``exec``, and so does every command of a test marked
``cold_start`` (Ctrl+C while torch loads, what a command imports). ``MULTILANE_TEST_COLD=1`` turns the
whole suite back to cold starts (and sets ``MULTILANE_TRIAL_START`` and ``MULTILANE_RANK_START`` to exec,
so that trials and ranks do too).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from typing import Any

from multilane.engine.start import server
from multilane.engine.start.cli_child import CLI_MODULE

_cold = threading.local()
ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))


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
    if len(args) >= 2 and args[0] == sys.executable and args[1].endswith(".py"):  # the repo's own scripts
        script = os.path.realpath(args[1])
        if any(script.startswith(os.path.join(ROOT, d, "")) for d in ("tests", "bench")):
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
            stdin, stdout, stderr = (
                fd if fd != -1 else std for fd, std in ((p2cread, 0), (c2pwrite, 1), (errwrite, 2))
            )
            self._warm = server.start_cli(
                self._warm_argv, stdin=stdin, stdout=stdout, stderr=stderr, env=env, cwd=cwd,
                new_session=bool(start_new_session),
            )  # fmt: skip
            self.pid = self._warm.pid
            self._child_created = True
        finally:
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)

    def _internal_poll(self, _deadstate: Any = None, **kw: Any) -> int | None:
        if self._warm is None:
            return super()._internal_poll(_deadstate, **kw)
        if self.returncode is None:
            self.returncode = self._warm.poll()
        return self.returncode

    def _wait(self, timeout: float | None) -> int:
        if self._warm is None:
            return super()._wait(timeout)
        if self.returncode is None:
            self.returncode = self._warm.wait(timeout)
        return self.returncode


def install() -> None:
    """Every ``subprocess.Popen`` (and so ``subprocess.run``) in this process is a ``WarmPopen``."""
    subprocess.Popen = WarmPopen  # type: ignore[misc]
    if os.environ.get("MULTILANE_TEST_COLD") == "1":
        os.environ.setdefault("MULTILANE_TRIAL_START", "exec")
        os.environ.setdefault("MULTILANE_RANK_START", "exec")
