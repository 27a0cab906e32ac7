"""How long each CPU lane (or a ddp rank on the CPU) has computed, counting the work still running.

A lane's busy time used to be credited when its work finished: a step longer than a telemetry record
read 0 % for every record it spanned and then 100 % (capped) for the one it ended in, so utilization
showed 0 % while training and a lane that finished a moment after another looked idle. Here the
seconds of work in flight count at once, so each record gets the busy time that fell within it.
"""

from __future__ import annotations

import threading
import time


class BusyClock:
    """Cumulative busy seconds of ``n`` lanes; ``start(i)`` and ``stop(i)`` bracket lane i's work."""

    def __init__(self, n: int) -> None:
        self._done = [0.0] * n
        self._since: list[float | None] = [None] * n
        self._lock = threading.Lock()

    def start(self, lane: int) -> None:
        with self._lock:
            self._since[lane] = time.perf_counter()

    def stop(self, lane: int) -> None:
        with self._lock:
            t0 = self._since[lane]
            if t0 is not None:
                self._done[lane] += time.perf_counter() - t0
                self._since[lane] = None

    def seconds(self) -> list[float]:
        """Each lane's busy seconds so far, its running work included up to now."""
        now = time.perf_counter()
        with self._lock:
            return [d + (now - s if s is not None else 0.0) for d, s in zip(self._done, self._since, strict=True)]
