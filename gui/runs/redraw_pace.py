"""How often the window redraws its plots while a run trains.

At most every ``REDRAW_MS`` (10 Hz), and never more often than keeps the redraws (the plots' refresh
and their paint, measured as they happen) under ``CPU_SHARE`` of the machine's cores. On a GPU
workstation with 16 cores a ~15 ms redraw allows 10 Hz; on a 2-core laptop training on its CPU, the
same redraw every 100 ms would take ~7% of the CPU away from training, so the window redraws about
three times a second instead (bench/gui_throughput.py; docs/performance.md).
"""

from __future__ import annotations

import os

REDRAW_MS = 100  # 10 Hz at most; a refresh and repaint of the plots cost ~15-20 ms (bench/gui_latency_probe.py)
MAX_REDRAW_MS = 1000  # the plots move at least once a second, whatever a redraw costs
CPU_SHARE = 0.02  # of the machine's cores, for the plots' redraws while a run trains


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class RedrawPace:
    """The redraw interval from the measured cost of recent redraws (an exponential mean)."""

    def __init__(self, cores: int | None = None, share: float = CPU_SHARE) -> None:
        self.cores = cores or usable_cores()
        self.share = share
        self.cost_s = 0.0

    def add(self, seconds: float) -> None:
        """One redraw's cost: its refresh and the paint that followed."""
        self.cost_s = seconds if self.cost_s == 0.0 else 0.8 * self.cost_s + 0.2 * seconds

    def interval_ms(self) -> int:
        ms = 1000.0 * self.cost_s / (self.share * self.cores)
        return int(min(MAX_REDRAW_MS, max(REDRAW_MS, ms)))
