"""What the live plots and the exported figures both derive from a run: x values, axis labels,
pause spans, curve names with units. No Qt, no matplotlib here."""

from __future__ import annotations

import numpy as np
from multilane.engine.numbers import format_number, format_percent
from multilane.engine.rundir.follow import DIVERGED
from multilane.gui.runs.run_data import RunData, Series

X_LABELS = {"step": "step", "time": "elapsed time (s)"}

# Names (with units) the app's hover header, the CSV's readers and the figures' axes use.
LABELS = {
    "loss": "train loss",
    "val_loss": "validation loss",
    "samples_per_s": "throughput (samples/s)",
    "tokens_per_s": "throughput (tokens/s)",
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
THROUGHPUT_TITLES = {"samples_per_s": "Throughput (samples/s)", "tokens_per_s": "Throughput (tokens/s)"}
# Each unit as its label writes it in parentheses ("step time (ms)": ms).
UNITS = {k: v[v.rindex("(") + 1 : -1] for k, v in LABELS.items() if v.endswith(")")}


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
        elif name in ("resumed", "stopped", "finished", "failed", DIVERGED) and start is not None:
            spans.append((start[0], wall - t0, start[1]))
            start = None
    if start is not None:
        last = max((float(s.get("wall_time")[-1]) for s in (run.train, run.telemetry) if s.rows), default=t0)
        spans.append((start[0], max(start[0], last - t0), start[1]))
    return spans


def run_breaks(run: RunData) -> list[tuple[float, float, str, int]]:
    """Each time the run did not train, as (start, end, what, step) in seconds since it began: a
    pause ("paused", until it resumed), a stop ("stopped", until a resume started it again)."""
    spans = [(a, b, "paused", s) for a, b, s in pause_spans(run)]
    t0 = run.t0 or 0.0
    stop: tuple[float, int] | None = None
    for ev in run.events:
        name, wall = ev.get("event"), float(ev.get("wall_time") or 0.0)
        if name in ("stopped", "failed", "finished", DIVERGED):
            stop = (wall - t0, int(ev.get("step") or 0))
        elif name == "started" and ev.get("resumed_from_step") is not None and stop is not None:
            spans.append((stop[0], max(stop[0], wall - t0), "stopped", int(ev["resumed_from_step"])))
            stop = None
    return sorted(spans)


GAP_FACTOR = 10.0  # a wait this many times the usual interval between records is a gap, not a trend
GAP_MIN_S = 10.0


def gap_breaks(run: RunData, wall: np.ndarray, by_interval: bool = True) -> np.ndarray:
    """Row positions where a curve's line must break (before that row): the first row after a pause,
    a stop or a resume, and (``by_interval``) after a wait far longer than the usual interval. A line
    across such a gap would draw a trend the data does not hold."""
    n = len(wall)
    if n < 2:
        return np.empty(0, dtype=np.int64)
    cuts = []
    t0 = run.t0 or 0.0
    for a, b, _what, _step in run_breaks(run):
        # rows up to the pause (or stop) on one side, rows from the resume on the other
        cuts.append(np.searchsorted(wall, [a + t0], side="right"))
        cuts.append(np.searchsorted(wall, [b + t0], side="left"))
    for ev in run.events:
        if ev.get("event") == "started" and ev.get("resumed_from_step") is not None:
            cuts.append(np.searchsorted(wall, [float(ev.get("wall_time") or 0.0)], side="left"))
    if by_interval:
        dt = np.diff(wall)
        sample = dt[:: max(1, len(dt) // 10_000)]
        sample = sample[np.isfinite(sample) & (sample > 0)]
        if len(sample):
            limit = max(GAP_FACTOR * float(np.median(sample)), GAP_MIN_S)
            with np.errstate(invalid="ignore"):
                cuts.append(np.flatnonzero(dt > limit) + 1)
    if not cuts:
        return np.empty(0, dtype=np.int64)
    out = np.unique(np.concatenate(cuts).astype(np.int64))
    return out[(out > 0) & (out < n)]


def broken(x: np.ndarray, y: np.ndarray, idx: np.ndarray, breaks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The samples at positions ``idx`` (sorted), with a NaN between two of them that a break separates."""
    vx, vy = x[idx], y[idx]
    if len(breaks) and len(idx) > 1:
        side = np.searchsorted(breaks, idx, side="right")
        cut = np.flatnonzero(np.diff(side)) + 1
        if len(cut):
            vx = np.insert(vx, cut, vx[cut - 1])
            vy = np.insert(vy.astype(float), cut, np.nan)
    return vx, vy


METRIC_NAMES = {"bits_per_byte": "bits per byte", "r2": "R²", "rmse": "RMSE", "mae": "MAE", "bpb": "bits per byte"}


def format_duration(seconds: float) -> str:
    """``42.0`` → "42 s", ``300`` → "5 min 0 s"."""
    if seconds < 60:
        return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"
    return f"{int(seconds // 60)} min {seconds % 60:.0f} s"


def metric_label(name: str) -> str:
    """A metric's name for people: ``bits_per_byte`` → "bits per byte", ``r2`` → "R²"."""
    return METRIC_NAMES.get(name, name.replace("_", " "))


def metric_title(names: list[str]) -> str:
    """The metric panel's title: the metrics it shows, by name (not "Validation metric")."""
    return " · ".join(metric_label(m) for m in names) if names else "Validation metric"


# Settings that name or place a run rather than shape its training: never "what differs".
_NOT_HYPERPARAMETERS = (
    "run.",
    "telemetry.",
    "health.",
    "train.checkpoint_",
    "train.log_every",
    "devices.collective_timeout_s",
)


def _flat(config: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out |= _flat(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


def differing_settings(runs: list[RunData]) -> list[dict[str, str]]:
    """For each run, the settings whose values differ between the runs (``{"optim.lr": "0.01"}``);
    runs without a readable config get an empty dict."""
    flats = [_flat(r.config) if isinstance(r.config, dict) else None for r in runs]
    known = [f for f in flats if f is not None]
    if len(known) < 2:
        return [{} for _ in runs]
    keys = sorted({k for f in known for k in f if not k.startswith(_NOT_HYPERPARAMETERS)})
    differ = [k for k in keys if len({repr(f.get(k)) for f in known}) > 1]
    return [{} if f is None else {k: _setting(f.get(k)) for k in differ} for f in flats]


def _setting(v: object) -> str:
    if isinstance(v, float):
        return f"{v:g}"  # a setting as the user typed it: 0.01, 3e-4
    if isinstance(v, (list, tuple)):
        return ",".join(str(x) for x in v)
    return "—" if v is None else str(v)


def settings_text(settings: dict[str, str]) -> str:
    """``{"optim.lr": "0.01", "data.batch_size": "64"}`` → "lr 0.01, batch_size 64"."""
    return ", ".join(f"{k.rsplit('.', 1)[-1]} {v}" for k, v in settings.items())


def step_total(series: Series) -> np.ndarray:
    """A train series' step time (ms): its ``step_ms``, or the sum of its phases."""
    if "step_ms" in series.columns:
        return series.get("step_ms")
    phases = [series.get(k) for k in series.names("phase/")]
    if not phases:
        return np.full(series.rows, np.nan)
    stack = np.vstack(phases)
    return np.where(np.isfinite(stack).any(axis=0), np.nansum(stack, axis=0), np.nan)


def _rank_parts(name: str) -> tuple[str, str, str] | None:
    """``host/rankN/device`` (a ddp or fsdp rank's device) as its three parts, else None."""
    parts = name.split("/")
    if len(parts) == 3 and parts[1].startswith("rank") and parts[1][4:].isdigit():
        return parts[0], parts[1], parts[2]
    return None


def compare_devices(runs: list[RunData]) -> list[str]:
    """Every device of the runs compared, in the first run's order, then each later run's new ones: a
    device's colour is its place here (the same as in its run's own view when the runs share their
    device list, as runs compared usually do). A rank's device is named as a device, not a rank, so
    that one device has one colour whatever the strategy: ``vm/rank0/cpu:0`` of a ddp run is the
    ``cpu:0`` of a replicate run (``host/cpu:0`` where the ranks ran on several hosts)."""
    raw: list[str] = []
    for run in runs:
        te = run.telemetry
        seen = [k.split("/", 1)[1] for p in ("util/", "mem/", "rss/") for k in te.names(p)]
        raw += [d for d in dict.fromkeys([*run.devices, *seen]) if d not in raw]
    hosts = {p[0] for d in raw if (p := _rank_parts(d)) is not None}
    names: list[str] = []
    for d in raw:
        p = _rank_parts(d)
        ident = d if p is None else p[2] if len(hosts) <= 1 else f"{p[0]}/{p[2]}"
        names += [ident] if ident not in names else []
    return names


def device_in(name: str, devices: list[str]) -> str:
    """The entry of ``compare_devices`` that a run's device ``name`` is (a rank's device by its device)."""
    if name in devices:
        return name
    p = _rank_parts(name)
    if p is not None:
        for candidate in (f"{p[0]}/{p[2]}", p[2]):
            if candidate in devices:
                return candidate
    return name


def rank_places(runs: list[RunData], devices: list[str]) -> dict[str, str]:
    """Which rank ran on each compared device, for the key: ``{"cpu:0": "rank 0"}`` (ranks that differ
    between runs: "rank 0, 1"); devices no rank ran on are absent."""
    ranks: dict[str, list[str]] = {}
    for run in runs:
        for d in run.devices:
            p = _rank_parts(d)
            if p is not None:
                mine = ranks.setdefault(device_in(d, devices), [])
                mine += [p[1][4:]] if p[1][4:] not in mine else []
    return {d: "rank " + ", ".join(r) for d, r in ranks.items()}


def compared_lines(run: RunData, devices: list[str]) -> dict[str, list[tuple[str, str | None]]]:
    """The telemetry columns a run draws when runs are compared, as (column, device; None: the process):
    ``util`` each device's utilization; ``memory`` each device's memory used (GPUs), each rank's process
    (ddp on the CPU), or the one process's RSS (CPU lanes, which share it). In ``devices`` order, each
    device named as in ``devices``."""
    te = run.telemetry
    order = {d: i for i, d in enumerate(devices)}

    def per_device(prefix: str) -> list[tuple[str, str | None]]:
        cols = [(k, device_in(k.split("/", 1)[1], devices)) for k in te.names(prefix)]
        return sorted(cols, key=lambda c: order.get(c[1], len(order)))

    memory = per_device("mem/") or per_device("rss/")
    if not memory and "rss_mb" in te.columns:
        memory = [("rss_mb", None)]
    return {"util": per_device("util/"), "memory": memory}


def describe(key: str) -> tuple[str, str]:
    """A column key as (name, unit) for people: ``util/cpu:0`` → ("cpu:0 utilization", "%")."""
    head, _, dev = key.partition("/")
    if head == "rss" and dev:  # a ddp rank's process on the CPU
        return f"{dev} process RSS", "MiB"
    if head in ("loss",) and dev:
        return f"{dev} loss", ""
    if head == "metric" and dev:
        return f"validation {metric_label(dev)}", ""
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
        (
            run.train,
            ["loss", *(f"loss/{dev}" for dev in run.devices), "samples_per_s", "tokens_per_s", "lr", "grad_norm"],
        ),
        (run.eval, ["val_loss", *(f"metric/{m}" for m in run.metric_names)]),
        (te, [*(n for k in ("util/", "mem/", "power/", "temp/") for n in te.names(k)), "rss_mb"]),
    ):
        if not series.rows:
            continue
        i = nearest_row(run, series, x, x_mode)
        for k in keys:
            v = series.get(k)[i]
            if np.isfinite(v):
                name, unit = describe(k)
                parts.append(f"{name} {value_text(v, unit)}")
    return " · ".join(parts)


def nearest_row(run: RunData, series: Series, x: float, x_mode: str) -> int:
    """The row of ``series`` (which has rows) nearest to ``x``."""
    xs = x_values(run, series, x_mode)
    i = int(np.clip(np.searchsorted(xs, x), 0, series.rows - 1))
    return i - 1 if i > 0 and abs(xs[i - 1] - x) < abs(xs[i] - x) else i


def value_text(v: float, unit: str) -> str:
    """A value with its unit, as the hover line prints it: "41%", "312.5 MiB", "0.0123"."""
    if unit == "%":
        return format_percent(v)
    if unit in ("W", "°C") or abs(v) >= 1000:
        return f"{v:,.0f}{'' if unit == '°C' else ' '}{unit}".rstrip()
    value = f"{v:,.1f}" if unit == "MiB" else format_number(v)
    return f"{value}{' ' if unit else ''}{unit}"


def compare_values_at(runs: list[RunData], x: float, x_mode: str) -> list[str]:
    """The parts of the hover line when runs are compared: every run by name, with its value in each compared panel
    at ``x`` (train and validation loss, metrics, throughput, learning rate, gradient norm, step time,
    each device's utilization and memory) — never one run's values without its name."""
    parts = [f"step {x:,.0f}" if x_mode == "step" else f"elapsed {x:,.1f} s"]
    devices = compare_devices(runs)
    for run in runs:
        values = []
        tr, ev, te = run.train, run.eval, run.telemetry
        if tr.rows:
            i = nearest_row(run, tr, x, x_mode)
            row = [(*describe(k), tr.get(k)[i]) for k in ("loss", *(f"loss/{dev}" for dev in run.devices))]
            row = [(name, v, unit) for name, unit, v in row]  # the train loss and each device's, named
            row += [(LABELS[k].split(" (")[0], tr.get(k)[i], UNITS.get(k, "")) for k in ("samples_per_s", "lr")]
            row += [("throughput", tr.get("tokens_per_s")[i], "tokens/s")] if "tokens_per_s" in tr.columns else []
            row += [("gradient norm", tr.get("grad_norm")[i], ""), ("step time", step_total(tr)[i], "ms")]
            values += row
        if ev.rows:
            i = nearest_row(run, ev, x, x_mode)
            values.append(("validation loss", ev.get("val_loss")[i], ""))
            values += [(metric_label(m), ev.get(f"metric/{m}")[i], "") for m in run.metric_names]
        if te.rows:  # each device's utilization and memory, by the device's name
            i = nearest_row(run, te, x, x_mode)
            lines = compared_lines(run, devices)
            for col, _dev in lines["util"] + lines["memory"]:
                name, unit = describe(col)
                values.append((name, te.get(col)[i], unit))
        shown = [f"{name} {value_text(v, unit)}" for name, v, unit in values if np.isfinite(v)]
        parts.append(f"{run.name}: {', '.join(shown) if shown else 'nothing logged here'}")
    return parts
