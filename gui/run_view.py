"""What the live plots and the exported figures both derive from a run: x values, axis labels,
pause spans, curve names with units. No Qt, no matplotlib here."""

from __future__ import annotations

import numpy as np
from multilane.gui.run_data import RunData, Series

X_LABELS = {"step": "step", "time": "elapsed time (s)"}

# Names (with units) the app's hover header, the CSV's readers and the figures' axes use.
LABELS = {
    "loss": "train loss",
    "val_loss": "validation loss",
    "samples_per_s": "throughput (samples/s)",
    "step_ms": "step time (ms)",
    "lr": "learning rate",
    "grad_norm": "gradient norm",
    "util": "utilization (%)",
    "mem": "memory used (MiB)",
    "alloc": "torch allocated (MiB)",
    "power": "power (W)",
    "temp": "temperature (°C)",
    "rss_mb": "process RSS (MiB)",
}
UNITS = {"samples_per_s": "samples/s", "step_ms": "ms", "util": "%", "mem": "MiB", "alloc": "MiB"}
UNITS |= {"power": "W", "temp": "°C", "rss_mb": "MiB"}


def x_values(run: RunData, series: Series, x_mode: str) -> np.ndarray:
    """A series' x: its step, or seconds since the run's first record."""
    if x_mode == "step":
        return series.get("step")
    return series.get("wall_time") - (run.t0 or 0.0)


def pause_spans(run: RunData) -> list[tuple[float, float, int]]:
    """Each pause as (start, end) in seconds since the run began, with the step it happened at.

    A pause with no matching resume (the run was stopped while paused) ends at the run's last record.
    """
    spans: list[tuple[float, float, int]] = []
    t0 = run.t0 or 0.0
    start: tuple[float, int] | None = None
    for ev in run.events:
        name = ev.get("event")
        wall = float(ev.get("wall_time") or 0.0)
        if name == "paused" and start is None:
            start = (wall - t0, int(ev.get("step") or 0))
        elif name in ("resumed", "stopped", "finished", "failed") and start is not None:
            spans.append((start[0], wall - t0, start[1]))
            start = None
    if start is not None:
        last = max((float(s.get("wall_time")[-1]) for s in (run.train, run.telemetry) if s.rows), default=t0)
        spans.append((start[0], max(start[0], last - t0), start[1]))
    return spans


def describe(key: str) -> tuple[str, str]:
    """A column key as (name, unit) for people: ``util/cpu:0`` → ("cpu:0 utilization", "%")."""
    head, _, dev = key.partition("/")
    if head in ("loss",) and dev:
        return f"{dev} loss", ""
    if head == "metric" and dev:
        return f"validation {dev}", ""
    if dev and head in UNITS:
        name = LABELS.get(head, head).split(" (")[0]
        return f"{dev} {name}", UNITS[head]
    name = LABELS.get(key, key).split(" (")[0]
    return name, UNITS.get(key, "")
