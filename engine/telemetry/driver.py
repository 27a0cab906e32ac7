"""Every call into the GPU driver (NVML's init and queries, CUDA's device count and properties), bounded
in time.

A wedged NVIDIA driver does not fail: ``nvmlInit`` or ``cuInit`` waits for ever, and so did
``multilane devices``. Here each call runs in a daemon thread that the caller waits on for at most
``TIMEOUT_S`` seconds; past that the caller gets ``DriverNotAnswering`` ("the NVIDIA driver did not
answer in 5 s"), a one-line ``UserError``, and the driver is taken as wedged for the rest of the
process: later calls fail at once instead of piling up threads behind the one that hangs (a thread
stuck in the driver cannot be stopped; as a daemon it does not keep the process from exiting).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

from multilane.engine.errors import UserError

TIMEOUT_S = 5.0
"""How long a call into the GPU driver may take before it is given up."""

T = TypeVar("T")
_wedged: str | None = None  # the line said when the driver first did not answer; later calls fail at once


class DriverNotAnswering(UserError):
    """The GPU driver did not answer a call within ``TIMEOUT_S`` seconds (now, or earlier in this process)."""


def driver_problem() -> str | None:
    """Why the driver is not asked any more in this process (it did not answer once), or None."""
    return _wedged


def bounded(fn: Callable[..., T], *args: Any, what: str = "the NVIDIA driver") -> T:
    """``fn(*args)``, or ``DriverNotAnswering`` when it has not returned within ``TIMEOUT_S`` seconds.
    What ``fn`` raises is raised here."""
    global _wedged
    if _wedged is not None:
        raise DriverNotAnswering(_wedged)
    timeout = TIMEOUT_S
    result: list[Any] = []
    error: list[BaseException] = []
    done = threading.Event()

    def call() -> None:
        try:
            result.append(fn(*args))
        except BaseException as e:  # handed to the caller's thread
            error.append(e)
        finally:
            done.set()

    threading.Thread(target=call, name="multilane-driver-call", daemon=True).start()
    if not done.wait(timeout):
        _wedged = f"{what} did not answer in {timeout:g} s"
        raise DriverNotAnswering(_wedged)
    if error:
        raise error[0]
    return result[0]
