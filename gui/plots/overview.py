"""``plots.*``: every panel of the app in one figure, for one run or for runs compared. No Qt here.

One run: loss (every device, the combined line thin on top, validation), the metric by its name,
throughput, learning rate, gradient norm, utilization and memory per device (equal lanes or ranks
all visible), power, temperature, and the step time split into its phases. Runs compared: each run
in its own colour in every panel but utilization and memory, where each device keeps its colour and
each run has its own line style; the key names each run with the settings that differ. Lines
break where the run paused, stopped or logged nothing for long; pauses and stops are marked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import matplotlib
import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from multilane.gui.plots.decimate import ema
from multilane.gui.plots.figures import RC, FigureOptions, _legend, draw_line, mark_breaks, run_labels, series_breaks
from multilane.gui.plots.palette import (
    COMBINED,
    GAP,
    NEUTRAL,
    VALIDATION,
    compared_width,
    device_width,
    run_dash,
    series_color,
)
from multilane.gui.plots.run_view import (
    LABELS,
    X_LABELS,
    compare_devices,
    compared_lines,
    metric_label,
    metric_title,
    step_total,
    x_values,
)
from multilane.gui.runs.run_data import RunData

# The step-time phases' colours, as in the app (style.py holds them for pyqtgraph; no Qt here).
PHASES = ["data", "scatter", "replicate", "forward", "loss", "backward", "reduce", "optimizer"]
PHASE_COLORS = ["#999999", "#E69F00", "#56B4E9", "#009E73", "#F0E442", "#0072B2", "#CC79A7", "#D55E00"]


@dataclass
class Panel:
    title: str
    ylabel: str
    curves: list[tuple] = field(default_factory=list)  # (x, y, breaks, style)
    log: bool = False
    from_zero: bool = False
    percent: bool = False
    stack: list[tuple] = field(default_factory=list)  # (x, bottom, top, breaks, colour, name)
    key: list[tuple[dict, str]] = field(default_factory=list)  # its own legend: (line style, name)


def _smooth(y: np.ndarray, opts: FigureOptions) -> np.ndarray:
    return ema(y, opts.smoothing) if opts.smoothing > 0 else y


def _positive(ys: Sequence[np.ndarray]) -> bool:
    finite = [y[np.isfinite(y)] for y in ys]
    values = np.concatenate(finite) if finite else np.empty(0)
    return bool(len(values)) and bool((values > 0).all())


def _run_panels(run: RunData, opts: FigureOptions) -> list[Panel]:
    tr, ev, te = run.train, run.eval, run.telemetry
    panels: list[Panel] = []
    if tr.rows:
        x, br = x_values(run, tr, opts.x_mode), series_breaks(run, tr)
        loss = Panel("Loss", "loss")
        devs = [d for d in run.devices if f"loss/{d}" in tr.columns]
        n = len(devs)
        for i, d in enumerate(devs):
            color = series_color(run.device_index(d))
            style = {"color": color, "label": d, "linewidth": device_width(i, n, 2.0, 1.4), "zorder": 2 + i}
            loss.curves.append((x, _smooth(tr.get(f"loss/{d}"), opts), br, style))
        width = 0.8 if n else 1.6  # thin and on top: every device's colour shows around it
        style = {"color": COMBINED, "linewidth": width, "label": "combined" if n else "train", "zorder": 20}
        loss.curves.append((x, _smooth(tr.get("loss"), opts), br, style))
        if ev.rows:
            xe = x_values(run, ev, opts.x_mode)
            style = {"color": VALIDATION, "linestyle": (0, (4, 2)), "label": "validation", "zorder": 21}
            style["marker"] = "o" if ev.rows <= 60 else None
            loss.curves.append((xe, ev.get("val_loss"), series_breaks(run, ev), style | {"markersize": 3}))
        loss.log = opts.log_y and _positive([c[1] for c in loss.curves])
        panels.append(loss)
    if ev.rows and run.metric_names:
        xe, br = x_values(run, ev, opts.x_mode), series_breaks(run, ev)
        names = run.metric_names
        metric = Panel(metric_title(names), metric_title(names))
        for i, m in enumerate(names):
            style = {"color": NEUTRAL if i == 0 else series_color(i), "label": metric_label(m), "marker": "o"}
            metric.curves.append((xe, ev.get(f"metric/{m}"), br, style | {"markersize": 3}))
        panels.append(metric)
    for key, title in ((run.throughput_key, "Throughput"), ("lr", "Learning rate"), ("grad_norm", "Gradient norm")):
        if tr.rows and key in tr.columns and np.isfinite(tr.get(key)).any():
            x, br = x_values(run, tr, opts.x_mode), series_breaks(run, tr)
            panels.append(Panel(title, LABELS[key], [(x, tr.get(key), br, {"color": NEUTRAL})], from_zero=key == "lr"))
    if te.rows:
        panels += _telemetry_panels(run, opts)
    if tr.rows:
        step = _step_panel(run, opts)
        if step is not None:
            panels.append(step)
    return panels


def _telemetry_panels(run: RunData, opts: FigureOptions) -> list[Panel]:
    te = run.telemetry
    xt = x_values(run, te, opts.x_mode)
    devs = sorted({k.split("/", 1)[1] for k in te.names("util/") + te.names("mem/") + te.names("rss/")})
    panels = []
    for prefix, title in (("util", "Utilization"), ("mem", "Memory"), ("power", "Power"), ("temp", "Temperature")):
        keys = [d for d in devs if f"{prefix}/{d}" in te.columns]
        if not keys:
            continue
        panel = Panel(title, LABELS[prefix], percent=prefix == "util", from_zero=prefix in ("mem", "power"))
        for j, d in enumerate(keys):
            y = te.get(f"{prefix}/{d}")
            keep = np.isfinite(y)
            style = {
                "color": series_color(run.device_index(d)),
                "label": d,
                "linewidth": device_width(j, len(keys), 1.8, 1.4),
            }
            style["zorder"] = 2 + j  # the first device widest: equal devices all show
            panel.curves.append((xt[keep], y[keep], series_breaks(run, te, keep), style))
        panels.append(panel)
    ranks = [k.split("/", 1)[1] for k in te.names("rss/")]
    if ranks and not te.names("mem/"):  # ddp on CPU: each rank's process
        panel = Panel("Memory", LABELS["rss_mb"], from_zero=True)
        for j, d in enumerate(ranks):
            y = te.get(f"rss/{d}")
            keep = np.isfinite(y)
            style = {"color": series_color(run.device_index(d)), "label": d, "zorder": 2 + j}
            style["linewidth"] = device_width(j, len(ranks), 1.8, 1.4)
            panel.curves.append((xt[keep], y[keep], series_breaks(run, te, keep), style))
        panels.append(panel)
    elif "rss_mb" in te.columns and not te.names("mem/"):
        y = te.get("rss_mb")
        keep = np.isfinite(y)
        curve = (xt[keep], y[keep], series_breaks(run, te, keep), {"color": NEUTRAL})
        panels.append(Panel("Memory", LABELS["rss_mb"], [curve], from_zero=True))
    return panels


def _step_panel(run: RunData, opts: FigureOptions) -> Panel | None:
    """The step time, stacked by phase as in the app (or the total, where phases were not logged)."""
    tr = run.train
    x, br = x_values(run, tr, opts.x_mode), series_breaks(run, tr)
    present = [(p, c) for p, c in zip(PHASES, PHASE_COLORS, strict=True) if f"phase/{p}" in tr.columns]
    panel = Panel("Step time", LABELS["step_ms"], from_zero=True)
    if present:
        bottom = np.zeros(tr.rows)
        for p, color in present:
            top = bottom + np.nan_to_num(tr.get(f"phase/{p}"))
            panel.stack.append((x, bottom, top, br, color, p))
            bottom = top
        return panel
    total = step_total(tr)
    if not np.isfinite(total).any():
        return None
    panel.curves.append((x, total, br, {"color": NEUTRAL}))
    return panel


def _comparison_panels(runs: Sequence[RunData], opts: FigureOptions) -> list[Panel]:
    """Every panel with one curve per run, in the run's colour."""
    loss, metric = Panel("Loss", "loss"), Panel("", "")
    single = {k: Panel(t, LABELS[k]) for k, t in (("samples_per_s", "Throughput"), ("lr", "Learning rate"))}
    single["grad_norm"] = Panel("Gradient norm", LABELS["grad_norm"])
    single["lr"].from_zero = True  # a constant lr is not a wall
    step = Panel("Step time (each run's total)", LABELS["step_ms"], from_zero=True)
    names: list[str] = []
    n = len(runs)
    for k, run in enumerate(runs):
        # equal runs hide none of each other: the first widest, each later one over it narrower
        wide, thin = device_width(k, n, 2.0, 1.6), device_width(k, n, 1.4, 1.6)
        solid = {"color": series_color(k), "linewidth": thin, "zorder": 2 + k}
        tr, ev = run.train, run.eval
        if tr.rows:
            x, br = x_values(run, tr, opts.x_mode), series_breaks(run, tr)
            loss.curves.append((x, _smooth(tr.get("loss"), opts), br, solid | {"linewidth": wide}))
            for key, panel in single.items():
                if key in tr.columns and np.isfinite(tr.get(key)).any():
                    panel.curves.append((x, tr.get(key), br, solid))
            total = step_total(tr)
            if np.isfinite(total).any():
                step.curves.append((x, total, br, solid))
        if ev.rows:
            xe, br = x_values(run, ev, opts.x_mode), series_breaks(run, ev)
            dashed = solid | {"linestyle": (0, (4, 2)), "linewidth": wide}
            dot = device_width(k, n, 3.0, 2.0)  # markers too: the first run's largest, each next one on top
            dashed |= {"marker": "o" if ev.rows <= 60 else None, "markersize": dot}
            loss.curves.append((xe, ev.get("val_loss"), br, dashed))
            for i, m in enumerate(run.metric_names):
                names += [m] if m not in names else []
                style = solid | {"marker": "o", "markersize": dot, "linestyle": "-" if i == 0 else ":"}
                metric.curves.append((xe, ev.get(f"metric/{m}"), br, style))
    metric.title = metric.ylabel = metric_title(names)
    loss.log = opts.log_y and _positive([c[1] for c in loss.curves])
    util, memory = _compared_device_panels(runs, opts)
    panels = [loss, metric, *single.values(), util, memory, step]
    return [p for p in panels if p.curves]


def _compared_device_panels(runs: Sequence[RunData], opts: FigureOptions) -> tuple[Panel, Panel]:
    """Utilization and memory of runs compared, as in the app: one line per device per run, in the
    device's colour, each run in its own line style (a dashed run's gaps white); the first run's lines
    widest, each later one over them narrower, so that equal lines all show. Their own key names both."""
    devices = compare_devices(list(runs))
    lines = [compared_lines(run, devices) if run.telemetry.rows else {"util": [], "memory": []} for run in runs]
    cols = [col for ln in lines for col, _ in ln["memory"]]
    process = any(c.startswith("rss") for c in cols)
    util = Panel("Utilization (colour: device, line: run)", LABELS["util"], percent=True)
    memory = Panel(f"{'Process memory: RSS' if process else 'Memory used'} (line: run)", "memory (MiB)", from_zero=True)
    for name, panel in (("util", util), ("memory", memory)):
        mine = [
            (k, run, col, dev) for k, (run, ln) in enumerate(zip(runs, lines, strict=True)) for col, dev in ln[name]
        ]
        present: list[str | None] = []
        m = max((sum(1 for p in mine if p[0] == k) for k in range(len(runs))), default=1)
        for i, (k, run, col, dev) in enumerate(mine):
            te = run.telemetry
            y = te.get(col)
            keep = np.isfinite(y)
            if not keep.any():
                continue
            color = NEUTRAL if dev is None else series_color(devices.index(dev))
            j = sum(1 for p in mine[:i] if p[0] == k)  # its place among its run's lines
            width = compared_width(k, len(runs), j, m, 1.0, 0.7, 1.2)
            style = {"color": color, "linewidth": width, "zorder": 2 + i}
            dash = run_dash(k)
            if dash is not None:
                style |= {"linestyle": (0, dash), "gapcolor": GAP}
            xt = x_values(run, te, opts.x_mode)
            panel.curves.append((xt[keep], y[keep], series_breaks(run, te, keep), style))
            present += [dev] if dev not in present else []
        if panel.curves:
            shown = [d for d in devices if d in present]
            panel.key = [({"color": series_color(devices.index(d)), "linewidth": 1.8}, d) for d in shown]
            for k, run in enumerate(runs):
                dash = run_dash(k)
                style = {"color": "#555", "linewidth": 1.4} | ({"linestyle": (0, dash)} if dash else {})
                panel.key.append((style, run.name))
    return util, memory


def _draw(fig: Figure, panels: list[Panel], run: RunData | None, opts: FigureOptions) -> None:
    """Two columns; an odd panel out at the end spans both, so no cell is left empty."""
    ncols = 2
    nrows = max(1, (len(panels) + 1) // 2)
    grid = fig.add_gridspec(nrows, ncols)
    first = None
    for i, panel in enumerate(panels):
        row, col = divmod(i, ncols)
        spot = grid[row, :] if i == len(panels) - 1 and len(panels) % 2 else grid[row, col]
        ax = fig.add_subplot(spot, sharex=first)
        first = first or ax
        for x, bottom, top, br, color, name in panel.stack:
            ax.fill_between(x, bottom, top, color=color, linewidth=0, label=name, where=_unbroken(len(x), br))
        for x, y, br, style in panel.curves:
            draw_line(ax, x, y, br, **style)
        if run is not None:
            mark_breaks(ax, run, opts, label=False)
        ax.set_title(panel.title, loc="left", fontsize=10)
        ax.set_ylabel(panel.ylabel)
        ax.set_xlabel(X_LABELS[opts.x_mode])
        ax.margins(x=0.01)
        ax.set_xlim(left=0)
        if panel.log:
            ax.set_yscale("log")
        if panel.percent:
            ax.set_ylim(0, 100)
        elif panel.from_zero:
            # from zero, with headroom: a flat 0.2 MiB wobble is not a cliff, nor a constant lr a wall
            tops = [np.nanmax(y) for _, y, _, _ in panel.curves if np.isfinite(y).any()]
            tops += [np.nanmax(t) for _, _, t, _, _, _ in panel.stack if len(t)]
            top = max(tops, default=1.0)
            ax.set_ylim(0, 1.1 * top if top > 0 else 1.0)
        if panel.key:
            handles = [Line2D([], [], **style) for style, _ in panel.key]
            _legend(ax, handles, [name for _, name in panel.key], below=True)
        elif sum(1 for *_, style in panel.curves if style.get("label")) > 1 or panel.stack:
            _legend(ax)


def _unbroken(n: int, breaks: np.ndarray) -> np.ndarray | None:
    """``fill_between``'s ``where``: a band stops at a break (the row before it ends the band)."""
    if not len(breaks):
        return None
    where = np.ones(n, dtype=bool)
    where[breaks - 1] = False
    return where


def overview_figure(run: RunData, opts: FigureOptions | None = None, caption: str | None = None) -> Figure:
    """Every plot of the app's panel that has data, the step time included, in a grid without holes."""
    opts = opts or FigureOptions()
    panels = _run_panels(run, opts)
    with matplotlib.rc_context(RC):
        nrows = max(1, (len(panels) + 1) // 2)
        fig = Figure(figsize=(opts.width_in * 1.45, 2.5 * nrows + 0.4), layout="constrained")
        _draw(fig, panels, run, opts)
        head = f"{run.name}" + (f" · {caption}" if caption else "")
        fig.suptitle(head, x=0.01, ha="left", fontweight="bold", fontsize=11, wrap=True)  # a long caption wraps
    return fig


def comparison_overview_figure(runs: Sequence[RunData], opts: FigureOptions | None = None) -> Figure:
    """Every panel with each run in its own colour; one key names each run and what differs."""
    opts = opts or FigureOptions()
    panels = _comparison_panels(runs, opts)
    with matplotlib.rc_context(RC):
        nrows = max(1, (len(panels) + 1) // 2)
        fig = Figure(figsize=(opts.width_in * 1.45, 2.5 * nrows + 1.0), layout="constrained")
        _draw(fig, panels, None, opts)
        handles = [Line2D([], [], color=series_color(i), linewidth=1.8) for i in range(len(runs))]
        labels = run_labels(runs)
        if len(runs) > 1:
            handles.append(Line2D([], [], color="#555", linewidth=1.0))
            labels.append("equal lines: the first run widest, each next one on top")
        if any(r.eval.rows for r in runs):
            handles.append(Line2D([], [], color="#555", linestyle=(0, (4, 2))))
            labels.append("validation (dashed)")
        fig.legend(handles, labels, loc="outside lower center", ncol=min(3, len(labels)), frameon=False)
        fig.suptitle(f"{len(runs)} runs compared", x=0.01, ha="left", fontweight="bold", fontsize=11)
    return fig
