"""No trial outlives its sweep: each trial runs in its own session (its process group holds the trial and
anything it starts: DataLoader workers, ddp ranks), and beside it runs a guard, a small stdlib-only
process that waits on a pipe whose other end only the sweep process holds. When the sweep ends by any
path (finished, stopped, exited after a second Ctrl+C, kill -9), the kernel closes that end; the guard
then gives the trial's group the grace to end and SIGKILLs whatever of it is left, which also ends a step
hung in C code that no signal handler reaches.

The trial itself gets SIGTERM when the sweep dies (a trial forked from the sweep's pre-imported server
watches the sweep's pidfd; one started with ``MULTILANE_TRIAL_START=exec`` has the kernel's
``PR_SET_PDEATHSIG``): a stop with a checkpoint once its step returns (the guard sends no second SIGTERM: that would abort it). Alone, that
signal could not end a hung step: its handler only sets a flag the step never reaches."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

GRACE_ENV = "MULTILANE_TRIAL_GRACE_S"
DEFAULT_GRACE_S = 30.0

GUARD = r"""
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGHUP, signal.SIG_IGN)
pgid, grace = int(sys.argv[1]), float(sys.argv[2])
while True:
    try:
        if not os.read(0, 64):
            break
    except InterruptedError:
        continue
    except OSError:
        break
def alive():
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
if alive():  # the leader has its parent-death SIGTERM (a second one would abort it): wait, then kill
    end = time.monotonic() + grace
    while alive() and time.monotonic() < end:
        time.sleep(0.1)
    if alive():
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass
"""


def grace_s() -> float:
    """Seconds a trial gets to stop (SIGTERM: a checkpoint) before SIGKILL; ``MULTILANE_TRIAL_GRACE_S``."""
    try:
        value = float(os.environ.get(GRACE_ENV, DEFAULT_GRACE_S))
    except ValueError:
        return DEFAULT_GRACE_S
    return value if 0 < value < 86400 else DEFAULT_GRACE_S


class TrialGuard:
    """The guard of one trial's process group; ``release`` when the trial has ended (leftovers of its
    group are then stopped the same way)."""

    def __init__(self, pgid: int) -> None:
        read_end, self._write_end = os.pipe()  # both close on exec: no other child inherits the sweep's end
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-S", "-c", GUARD, str(pgid), str(grace_s())],
                stdin=read_end,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # the terminal's Ctrl+C is the sweep's to handle, not the guard's
            )
        finally:
            os.close(read_end)

    def release(self) -> None:
        if self._write_end >= 0:
            with contextlib.suppress(OSError):
                os.close(self._write_end)
            self._write_end = -1


def signal_group(pgid: int, sig: int) -> None:
    """``sig`` to a trial's whole process group (gone already: nothing to do)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
