"""What the live plots and the exported figures both derive from a run: x values, axis labels,
pause spans, curve names with units. No Qt, no matplotlib here."""

from __future__ import annotations

import numpy as np
from multilane.gui.runs.run_data import RunData, Series

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


def values_at(run: RunData, x: float, x_mode: str) -> str:
    """Every logged value at ``x`` (the nearest record of each kind), named, with its unit: the hover line."""
    parts = [f"step {x:,.0f}" if x_mode == "step" else f"elapsed {x:,.1f} s"]
    te = run.telemetry
    for series, keys in (
        (run.train, ["loss", *(f"loss/{dev}" for dev in run.devices), "samples_per_s", "lr", "grad_norm"]),
        (run.eval, ["val_loss", *(f"metric/{m}" for m in run.metric_names)]),
        (te, [*(n for k in ("util/", "mem/", "power/", "temp/") for n in te.names(k)), "rss_mb"]),
    ):
        if not series.rows:
            continue
        xs = x_values(run, series, x_mode)
        i = int(np.clip(np.searchsorted(xs, x), 0, series.rows - 1))
        if i > 0 and abs(xs[i - 1] - x) < abs(xs[i] - x):
            i -= 1
        for k in keys:
            v = series.get(k)[i]
            if np.isfinite(v):
                name, unit = describe(k)
                if unit in ("%", "W", "°C") or abs(v) >= 1000:
                    value = f"{v:,.0f}"
                else:
                    value = f"{v:,.1f}" if unit == "MiB" else f"{v:.4g}"
                parts.append(f"{name} {value}{'' if unit in ('', '%', '°C') else ' '}{unit}")
    return " · ".join(parts)
