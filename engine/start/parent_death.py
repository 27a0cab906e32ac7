"""A child that ends when its parent does, two ways: the kernel's parent-death signal (the parent it was
forked or started by) and a watch on a process descriptor (any process, e.g. the sweep that asked a
server to fork the child)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import threading

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """In the child: ``sig`` when the thread that started it ends (Linux's ``PR_SET_PDEATHSIG``; elsewhere
    nothing, and whoever guards the child stops it)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig))


def sigterm_with_parent() -> None:
    """``die_with_parent(SIGTERM)``, as a ``preexec_fn``: a stop with a checkpoint once the step returns."""
    die_with_parent(signal.SIGTERM)


def signal_when_gone(pidfd: int, sig: int = signal.SIGTERM) -> threading.Thread:
    """In the child: a daemon thread that sends ``sig`` to this process once the process that ``pidfd``
    names has ended (a pidfd reads ready then). The descriptor is not passed on to what the child starts."""
    os.set_inheritable(pidfd, False)

    def watch() -> None:
        while True:
            try:
                ready, _, _ = select.select([pidfd], [], [])
            except InterruptedError:
                continue
            except OSError:
                return
            if ready:
                with contextlib.suppress(OSError):
                    os.kill(os.getpid(), sig)
                return

    t = threading.Thread(target=watch, name="multilane-parent-watch", daemon=True)
    t.start()
    return t
