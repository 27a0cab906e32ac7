"""Timing several loops fairly: each function steps in turn, in a new shuffled order every round, so
that whatever else the machine does lands on all of them alike. Shared by the bench scripts."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable


def interleaved(fns: dict[str, Callable[[], None]], rounds: int, seed: int = 0) -> dict[str, float]:
    """The median time of one call of each function, in seconds, over ``rounds`` interleaved rounds."""
    return {k: statistics.median(v) for k, v in step_times(fns, rounds, seed).items()}


def trimmed_mean(times: list[float], cut: float = 0.02) -> float:
    """The mean of ``times`` without their slowest ``cut`` (a hiccup of the machine in one call), which
    keeps what a periodic slow call (one in 10) adds, unlike the median."""
    kept = sorted(times)[: max(1, round(len(times) * (1 - cut)))]
    return statistics.fmean(kept)


def step_times(fns: dict[str, Callable[[], None]], rounds: int, seed: int = 0) -> dict[str, list[float]]:
    """Each call's time of each function, in seconds, over ``rounds`` interleaved rounds."""
    rng = random.Random(seed)
    times: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for _ in range(rounds):
        rng.shuffle(names)
        for k in names:
            t0 = time.perf_counter()
            fns[k]()
            times[k].append(time.perf_counter() - t0)
    return times
