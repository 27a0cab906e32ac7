"""Static figures of a run, or of runs side by side, for papers and reports: matplotlib, no Qt.

pyqtgraph draws the live plots; matplotlib is what papers are made with. Its PNG, SVG and PDF come
from one layout (the same pixel in each), with real text in the vector files (``svg.fonttype =
"none"``, ``pdf.fonttype = 42``: TrueType, selectable and searchable), a fixed size in inches so
fonts read at the size they print, and legends outside the axes so they cover no data.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from multilane.engine.errors import UserError
from multilane.gui.plots.decimate import ema
from multilane.gui.plots.palette import COMBINED, NEUTRAL, VALIDATION, series_color
from multilane.gui.plots.run_view import LABELS, X_LABELS, pause_spans, x_values
from multilane.gui.runs.run_data import RunData, recorded

FORMATS = ("png", "svg", "pdf")

RC = {
    "font.family": "sans-serif",
    "font.sans-serif": ["DejaVu Sans", "Arial", "Helvetica", "Liberation Sans"],
    "font.size": 10,
    "axes.titlesize": 11,
    "axes.labelsize": 10,
    "xtick.labelsize": 9,
    "ytick.labelsize": 9,
    "legend.fontsize": 9,
    "legend.frameon": False,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.color": "#e4e4e4",
    "grid.linewidth": 0.6,
    "axes.axisbelow": True,
    "lines.linewidth": 1.4,
    "svg.fonttype": "none",  # text stays <text>, editable and searchable
    "pdf.fonttype": 42,  # TrueType embedded: real text, not Type 3 glyph drawings
    "ps.fonttype": 42,
    "svg.hashsalt": "multilane",  # identical files for identical runs
}


@dataclass
class FigureOptions:
    """How a figure looks; the defaults fit a two-column paper's full width."""

    width_in: float = 7.0
    height_in: float = 3.6
    smoothing: float = 0.0  # EMA alpha as in the app's slider, [0, 1)
    x_mode: str = "step"  # or "time"
    log_y: bool = False

    def dpi_for(self, width_px: int) -> float:
        return max(50.0, width_px / self.width_in)


def run_caption(run_dir: str | Path) -> str | None:
    """One line of what the run was: task, devices, batch, optimizer; None without a readable config."""
    try:
        cfg = json.loads((Path(run_dir) / "config.json").read_text(encoding="utf-8"))
        task, optim = cfg["task"]["name"], cfg["optim"]
        parts = [f"task {task}", f"devices {cfg['devices']['use']}", f"batch {cfg['data']['batch_size']}"]
        parts.append(f"{optim['name']} lr {optim['lr']:g}")
        return " · ".join(parts)[:200]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _finish_axes(ax: Axes, opts: FigureOptions, ylabel: str, log_y: bool = False) -> None:
    ax.set_xlabel(X_LABELS[opts.x_mode])
    ax.set_ylabel(ylabel)
    ax.margins(x=0.01)
    if log_y:
        ax.set_yscale("log")


def _legend(ax: Axes, handles: list | None = None, labels: list[str] | None = None) -> None:
    """Outside the axes — right of them, or under them when the names are long: a legend there
    covers no data however the curves run."""
    if handles is None or labels is None:
        handles, labels = ax.get_legend_handles_labels()
    if not handles:
        return
    if max(len(label) for label in labels) > 22:
        ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, borderaxespad=0.0)
    else:
        ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def _train_curve(ax: Axes, x: np.ndarray, y: np.ndarray, opts: FigureOptions, **kw) -> None:
    """A train curve, smoothed as in the app when asked (the raw data faint behind it)."""
    if opts.smoothing > 0:
        ax.plot(x, y, color=kw["color"], alpha=0.22, linewidth=0.8, zorder=kw.get("zorder", 2) - 0.5)
        y = ema(y, opts.smoothing)
    ax.plot(x, y, **kw)


def _mark_pauses(ax: Axes, run: RunData, opts: FigureOptions) -> None:
    if opts.x_mode != "time":
        return
    for k, (a, b, _step) in enumerate(pause_spans(run)):
        ax.axvspan(a, b, color="#d9d9d9", alpha=0.6, linewidth=0, zorder=0, label="paused" if k == 0 else None)


def _validation(ax: Axes, run: RunData, opts: FigureOptions, color: str, label: str) -> None:
    ev = run.eval
    if not ev.rows or "val_loss" not in ev.columns:
        return
    marker = "o" if ev.rows <= 60 else None
    ax.plot(
        x_values(run, ev, opts.x_mode),
        ev.get("val_loss"),
        color=color,
        linestyle=(0, (4, 2)),
        linewidth=1.6,
        marker=marker,
        markersize=3.5,
        label=label,
        zorder=4,
    )


def _positive(runs: Iterable[RunData]) -> bool:
    values = [r.train.get("loss") for r in runs] + [r.eval.get("val_loss") for r in runs]
    finite = np.concatenate([v[np.isfinite(v)] for v in values]) if values else np.empty(0)
    return bool(len(finite)) and bool((finite > 0).all())


def _title(fig: Figure, ax: Axes, title: str, caption: str | None, smoothing: float) -> None:
    """The run's name in bold over the figure; what it was (task, devices, smoothing) small under it."""
    fig.suptitle(title, x=0.01, ha="left", fontweight="bold", fontsize=11)
    extra = [caption] if caption else []
    if smoothing > 0:
        extra.append(f"smoothed: EMA {smoothing:.2f}, raw data faint")
    if extra:
        ax.set_title(" · ".join(extra), loc="left", fontsize=8, color="#555")


def loss_figure(run: RunData, opts: FigureOptions | None = None, caption: str | None = None) -> Figure:
    """One run's loss: every device, the combined loss and validation, named; title with the run."""
    opts = opts or FigureOptions()
    with matplotlib.rc_context(RC):
        fig = Figure(figsize=(opts.width_in, opts.height_in), layout="constrained")
        ax = fig.add_subplot()
        tr = run.train
        if tr.rows:
            x = x_values(run, tr, opts.x_mode)
            for i, dev in enumerate(run.devices):
                _train_curve(ax, x, tr.get(f"loss/{dev}"), opts, color=series_color(i), label=dev, zorder=2)
            if "loss" in tr.columns:
                label = "combined" if run.devices else "train"
                _train_curve(ax, x, tr.get("loss"), opts, color=COMBINED, linewidth=2.0, label=label, zorder=3)
        _validation(ax, run, opts, VALIDATION, "validation")
        _mark_pauses(ax, run, opts)
        _finish_axes(ax, opts, "loss", log_y=opts.log_y and _positive([run]))
        _title(fig, ax, f"Loss · {run.name}", caption, opts.smoothing)
        _legend(ax)
    return fig


def comparison_figure(runs: Sequence[RunData], opts: FigureOptions | None = None) -> Figure:
    """Runs side by side: one colour per run, its train loss solid and its validation dashed."""
    opts = opts or FigureOptions()
    with matplotlib.rc_context(RC):
        fig = Figure(figsize=(opts.width_in, opts.height_in), layout="constrained")
        ax = fig.add_subplot()
        for i, run in enumerate(runs):
            color = series_color(i)
            if run.train.rows and "loss" in run.train.columns:
                x = x_values(run, run.train, opts.x_mode)
                _train_curve(ax, x, run.train.get("loss"), opts, color=color, linewidth=1.8, label=run.name, zorder=3)
            _validation(ax, run, opts, color, f"{run.name} (validation)")
        _finish_axes(ax, opts, "loss", log_y=opts.log_y and _positive(runs))
        _title(fig, ax, f"Loss · {len(runs)} runs compared", None, opts.smoothing)
        # one entry per run, and what solid and dashed mean once, not a validation entry per run
        handles = [Line2D([], [], color=series_color(i), linewidth=1.8) for i in range(len(runs))]
        labels = [r.name for r in runs]
        if any(r.eval.rows for r in runs):
            handles += [
                Line2D([], [], color="#555", linewidth=1.8),
                Line2D([], [], color="#555", linestyle=(0, (4, 2))),
            ]
            labels += ["train (solid)", "validation (dashed)"]
        _legend(ax, handles, labels)
    return fig


def overview_figure(run: RunData, opts: FigureOptions | None = None, caption: str | None = None) -> Figure:
    """Every plot of the app's panel that has data, in a grid with one shared x label."""
    opts = opts or FigureOptions()
    tr, ev, te = run.train, run.eval, run.telemetry
    panels: list[tuple[str, str, list[tuple[np.ndarray, np.ndarray, dict]], bool]] = []
    if tr.rows:
        x = x_values(run, tr, opts.x_mode)
        smooth = (lambda y: ema(y, opts.smoothing)) if opts.smoothing > 0 else (lambda y: y)
        curves = [
            (x, smooth(tr.get(f"loss/{d}")), {"color": series_color(i), "label": d}) for i, d in enumerate(run.devices)
        ]
        curves.append((x, smooth(tr.get("loss")), {"color": COMBINED, "linewidth": 2.0, "label": "combined"}))
        if ev.rows:
            xe = x_values(run, ev, opts.x_mode)
            style = {"color": VALIDATION, "linestyle": (0, (4, 2)), "label": "validation"}
            curves.append((xe, ev.get("val_loss"), style | {"marker": "o" if ev.rows <= 60 else None, "ms": 3}))
        panels.append(("Loss", "loss", curves, opts.log_y and _positive([run])))
    if ev.rows and run.metric_names:
        xe = x_values(run, ev, opts.x_mode)
        curves = [
            (
                xe,
                ev.get(f"metric/{m}"),
                {"color": NEUTRAL if i == 0 else series_color(i), "label": m, "marker": "o", "ms": 3},
            )
            for i, m in enumerate(run.metric_names)
        ]
        panels.append(("Validation metric", ", ".join(run.metric_names), curves, False))
    for key, title in (("samples_per_s", "Throughput"), ("lr", "Learning rate"), ("grad_norm", "Gradient norm")):
        if tr.rows and key in tr.columns and np.isfinite(tr.get(key)).any():
            x = x_values(run, tr, opts.x_mode)
            panels.append((title, LABELS[key], [(x, tr.get(key), {"color": NEUTRAL})], False))
    if te.rows:
        xt = x_values(run, te, opts.x_mode)
        devs = sorted({k.split("/", 1)[1] for k in te.names("util/") + te.names("mem/")})
        order = {d: run.devices.index(d) if d in run.devices else len(run.devices) + i for i, d in enumerate(devs)}
        for prefix, title in (("util", "Utilization"), ("mem", "Memory"), ("power", "Power"), ("temp", "Temperature")):
            keys = [d for d in devs if f"{prefix}/{d}" in te.columns]
            if keys:
                curves = [
                    (*recorded(xt, te.get(f"{prefix}/{d}")), {"color": series_color(order[d]), "label": d})
                    for d in keys
                ]
                panels.append((title, LABELS[prefix], curves, False))
        if te.names("rss/") and not te.names("mem/"):  # ddp on CPU: each rank's process
            rss = [k.split("/", 1)[1] for k in te.names("rss/")]
            curves = [
                (*recorded(xt, te.get(f"rss/{d}")), {"color": series_color(order.get(d, i)), "label": d})
                for i, d in enumerate(rss)
            ]
            panels.append(("Memory", LABELS["rss_mb"], curves, False))
        elif "rss_mb" in te.columns and not te.names("mem/"):
            panels.append(("Memory", LABELS["rss_mb"], [(*recorded(xt, te.get("rss_mb")), {"color": NEUTRAL})], False))
    with matplotlib.rc_context(RC):
        ncols = 2
        nrows = max(1, (len(panels) + ncols - 1) // ncols)
        fig = Figure(figsize=(opts.width_in * 1.45, 2.5 * nrows + 0.4), layout="constrained")
        axes = fig.subplots(nrows, ncols, squeeze=False, sharex=True).ravel()
        for ax, (title, ylabel, curves, log) in zip(axes, panels, strict=False):
            for x, y, style in curves:
                style = dict(style)
                ms = style.pop("ms", None)
                if ms:
                    style["markersize"] = ms
                ax.plot(x, y, **style)
            _mark_pauses(ax, run, opts)
            ax.set_title(title, loc="left", fontsize=10)
            ax.set_ylabel(ylabel)
            ax.margins(x=0.01)
            if log:
                ax.set_yscale("log")
            if title == "Utilization":
                ax.set_ylim(0, 100)
            if title in ("Memory", "Learning rate", "Power"):
                # from zero, with headroom: a flat 0.2 MiB wobble is not a cliff, nor a constant lr a wall
                top = max((np.nanmax(y) for _, y, _ in curves if np.isfinite(y).any()), default=1.0)
                ax.set_ylim(0, 1.1 * top if top > 0 else 1.0)
            if len(curves) > 1:
                _legend(ax)
        for ax in axes[len(panels) :]:
            ax.set_visible(False)
        for ax in axes[-ncols:]:
            ax.set_xlabel(X_LABELS[opts.x_mode])
        for ax in axes[: len(panels)]:
            ax.tick_params(labelbottom=True)
        head = f"{run.name}" + (f" · {caption}" if caption else "")
        fig.suptitle(head, x=0.01, ha="left", fontweight="bold", fontsize=11)
    return fig


def save_figure(
    fig: Figure, stem: str | Path, formats: Iterable[str], width_px: int, opts: FigureOptions
) -> list[Path]:
    """Write ``stem.png`` (``width_px`` wide), ``stem.svg`` and ``stem.pdf``: one layout in all three."""
    written = []
    dpi = width_px / fig.get_figwidth()
    for fmt in formats:
        if fmt not in FORMATS:
            continue
        path = Path(f"{stem}.{fmt}")
        try:
            with matplotlib.rc_context(RC):
                fig.savefig(path, format=fmt, dpi=dpi, facecolor="white", metadata=_metadata(fmt))
        except OSError as e:
            raise UserError(f"export: cannot write {path} ({e.strerror or e})") from None
        written.append(path)
    return written


def _metadata(fmt: str) -> dict[str, str | None]:
    if fmt == "png":
        return {"Software": "Multilane (matplotlib)"}
    if fmt == "svg":
        return {"Date": None, "Creator": "Multilane (matplotlib)"}  # no date: identical runs, identical files
    if fmt == "pdf":
        return {"CreationDate": None, "Creator": "Multilane (matplotlib)"}
    return {}
