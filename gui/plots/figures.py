"""Static figures of a run, or of runs side by side, for papers and reports: matplotlib, no Qt.

pyqtgraph draws the live plots; matplotlib is what papers are made with. Its PNG, SVG and PDF come
from one layout (the same pixel in each), with real text in the vector files (``svg.fonttype =
"none"``, ``pdf.fonttype = 42``: TrueType, selectable and searchable), a fixed size in inches so
fonts read at the size they print, and legends outside the axes so they cover no data.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.transforms import offset_copy
from multilane.engine.errors import UserError
from multilane.engine.rundir.follow import TERMINAL_STATES, clean_status
from multilane.engine.rundir.readfile import read_regular_file
from multilane.engine.rundir.runlog import iter_metrics
from multilane.engine.rundir.runread import JSON_LIMIT, STATUS
from multilane.gui.plots.decimate import ema
from multilane.gui.plots.palette import COMBINED, VALIDATION, device_width, series_color
from multilane.gui.plots.run_view import (
    X_LABELS,
    differing_settings,
    gap_breaks,
    run_breaks,
    settings_text,
    x_values,
)
from multilane.gui.runs.run_data import RunData, Series

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
    """One line of what the run was: task, strategy, devices, batch, optimizer, and how it ended when it did
    not finish ("diverged at step 8": its loss went NaN; "stopped at step 40"); None without a readable config."""
    try:
        cfg = json.loads((Path(run_dir) / "config.json").read_text(encoding="utf-8"))
        task, optim, devices = cfg["task"]["name"], cfg["optim"], cfg["devices"]
        strategy = devices.get("strategy") or "replicate"
        parts = [f"task {task}", f"{strategy} on {devices['use']}", f"batch {cfg['data']['batch_size']}"]
        parts.append(f"{optim['name']} lr {optim['lr']:g}")
    except (OSError, ValueError, KeyError, TypeError):
        return None
    parts += _language_numbers(run_dir)
    end = _run_end(run_dir)
    return " · ".join(parts)[:240] + (f" · {end}" if end else "")


def _language_numbers(run_dir: str | Path) -> list[str]:
    """A language model's run: its mean tokens/s and best validation perplexity; nothing for other runs."""
    tokens, ppl = [], []
    with contextlib.suppress(OSError, ValueError):
        for rec in iter_metrics(Path(run_dir) / "metrics.jsonl"):
            v = rec.get("tokens_per_s" if rec.get("kind") == "train" else "perplexity")
            if isinstance(v, (int, float)) and math.isfinite(v):
                (tokens if rec.get("kind") == "train" else ppl).append(float(v))
    parts = [f"{sum(tokens) / len(tokens):,.0f} tokens/s"] if tokens else []
    return parts + ([f"best perplexity {min(ppl):.4g}"] if ppl else [])


def _run_end(run_dir: str | Path) -> str | None:
    """ "diverged at step 8" (or stopped, failed, aborted) from the run's status.json; None for a run that
    finished or is still running, or a status that cannot be read."""
    try:
        status = clean_status(json.loads(read_regular_file(Path(run_dir) / STATUS, JSON_LIMIT)))
    except (OSError, ValueError):
        return None
    if status is None or status["state"] not in TERMINAL_STATES or status["state"] == "finished":
        return None
    step = status.get("step")
    return status["state"] + (f" at step {step:,}" if isinstance(step, int) else "")


def _finish_axes(ax: Axes, opts: FigureOptions, ylabel: str, log_y: bool = False) -> None:
    ax.set_xlabel(X_LABELS[opts.x_mode])
    ax.set_ylabel(ylabel)
    ax.margins(x=0.01)
    ax.set_xlim(left=0)  # from the run's start, as in plots.* and the app (no step or second before it)
    if log_y:
        ax.set_yscale("log")


def _legend(ax: Axes, handles: list | None = None, labels: list[str] | None = None, below: bool = False) -> None:
    """Outside the axes — right of them, or under them when the names are long (or ``below``): a legend
    there covers no data however the curves run. In a grid of plots, one right of its axes takes its
    width from every plot of its column."""
    if handles is None or labels is None:
        handles, labels = ax.get_legend_handles_labels()
    if not handles:
        return
    longest = max(len(label) for label in labels)
    if below or longest > 22:
        ncol = 2 if longest > 12 else min(4, len(labels))
        # under the tick labels and the x label (about 30 pt), whatever the plot's height: at a fixed
        # share of it (-0.2) the legend covered the x label of a short plot
        under = offset_copy(ax.transAxes, fig=ax.figure, y=-34, units="points")
        ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), bbox_transform=under, ncol=ncol)
    else:
        ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def draw_line(ax: Axes, x: np.ndarray, y: np.ndarray, breaks: np.ndarray | None = None, **kw) -> None:
    """``ax.plot`` that breaks the line at ``breaks`` (rows after a pause, stop or gap: no trend drawn
    across them) and marks each point with no neighbour drawn (a curve's only point, a step logged alone
    between two stops), which a line alone would not draw."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    if breaks is not None and len(breaks):
        x = np.insert(x, breaks, x[breaks - 1])
        y = np.insert(y, breaks, np.nan)
    finite = np.isfinite(y)
    alone = finite.copy()  # a point with no drawn neighbour: a line of one point draws nothing
    alone[1:] &= ~finite[:-1]
    alone[:-1] &= ~finite[1:]
    if alone.any() and kw.get("marker") is None:
        kw["marker"] = "o"
        kw["markevery"] = alone.tolist()  # those points only
        kw.setdefault("markersize", 4)
    ax.plot(x, y, **kw)


def series_breaks(run: RunData, series: Series, keep: np.ndarray | None = None) -> np.ndarray:
    wall = series.get("wall_time")
    return gap_breaks(run, wall if keep is None else wall[keep], by_interval=series is not run.eval)


def _train_curve(ax: Axes, x: np.ndarray, y: np.ndarray, opts: FigureOptions, breaks=None, **kw) -> None:
    """A train curve, smoothed as in the app when asked (the raw data faint behind it)."""
    if opts.smoothing > 0:
        z = kw.get("zorder", 2) - 0.5
        draw_line(ax, x, y, breaks, color=kw["color"], alpha=0.22, linewidth=0.8, zorder=z)
        y = ema(y, opts.smoothing)
    draw_line(ax, x, y, breaks, **kw)


def mark_breaks(ax: Axes, run: RunData, opts: FigureOptions, label: bool = True) -> None:
    """Pauses and stops as in the app: a band on the time axis, a line at the step on the step axis."""
    seen: set[str] = set()
    for a, b, what, step in run_breaks(run):
        name = "paused" if what == "paused" else "stopped, then resumed"
        tag = name if label and name not in seen else None
        seen.add(name)
        if opts.x_mode == "time":
            shade = "#d9d9d9" if what == "paused" else "#bdbdbd"
            ax.axvspan(a, b, color=shade, alpha=0.6, linewidth=0, zorder=0, label=tag)
        else:
            style = ":" if what == "paused" else "--"
            ax.axvline(step, color="#888", linestyle=style, linewidth=1.0, zorder=0, label=tag)


def _validation(
    ax: Axes, run: RunData, opts: FigureOptions, color: str, label: str, width: float = 1.6, zorder: float = 4
) -> None:
    ev = run.eval
    if not ev.rows or "val_loss" not in ev.columns:
        return
    marker = "o" if ev.rows <= 60 else None
    draw_line(
        ax,
        x_values(run, ev, opts.x_mode),
        ev.get("val_loss"),
        series_breaks(run, ev),
        color=color,
        linestyle=(0, (4, 2)),
        linewidth=width,
        marker=marker,
        markersize=3.5,
        label=label,
        zorder=zorder,
    )


def _positive(runs: Iterable[RunData]) -> bool:
    values = [r.train.get("loss") for r in runs] + [r.eval.get("val_loss") for r in runs]
    finite = np.concatenate([v[np.isfinite(v)] for v in values]) if values else np.empty(0)
    return bool(len(finite)) and bool((finite > 0).all())


def _title(fig: Figure, ax: Axes, title: str, caption: str | None, smoothing: float) -> None:
    """The run's name in bold over the figure; what it was (task, devices, smoothing) small under it."""
    fig.suptitle(title, x=0.01, ha="left", fontweight="bold", fontsize=11, wrap=True)
    extra = [caption] if caption else []
    if smoothing > 0:
        extra.append(f"smoothed: EMA {smoothing:.2f}, raw data faint")
    if extra:
        ax.set_title(" · ".join(extra), loc="left", fontsize=8, color="#555", wrap=True)  # a long caption wraps


def loss_figure(run: RunData, opts: FigureOptions | None = None, caption: str | None = None) -> Figure:
    """One run's loss: every device, the combined loss and validation, named; title with the run."""
    opts = opts or FigureOptions()
    with matplotlib.rc_context(RC):
        fig = Figure(figsize=(opts.width_in, opts.height_in), layout="constrained")
        ax = fig.add_subplot()
        tr = run.train
        if tr.rows:
            x, br = x_values(run, tr, opts.x_mode), series_breaks(run, tr)
            devs = [d for d in run.devices if f"loss/{d}" in tr.columns]
            n = len(devs)
            for i, dev in enumerate(devs):
                # the first device widest, each later one over it narrower: equal lanes all show
                width = device_width(i, n, 2.0, 1.4)
                y, color = tr.get(f"loss/{dev}"), series_color(run.device_index(dev))
                _train_curve(ax, x, y, opts, br, color=color, label=dev, linewidth=width, zorder=2 + i)
            if "loss" in tr.columns:
                # thin, on top: the devices' colours show around it
                label = "combined" if run.devices else "train"
                width = 0.8 if run.devices else 1.6
                _train_curve(ax, x, tr.get("loss"), opts, br, color=COMBINED, linewidth=width, label=label, zorder=20)
        _validation(ax, run, opts, VALIDATION, "validation")
        mark_breaks(ax, run, opts)
        _finish_axes(ax, opts, "loss", log_y=opts.log_y and _positive([run]))
        _title(fig, ax, f"Loss · {run.name}", caption, opts.smoothing)
        _legend(ax)
    return fig


def run_labels(runs: Sequence[RunData]) -> list[str]:
    """Each run's name with the settings that differ between the runs: "b (lr 0.05, batch_size 32)"."""
    return [
        r.name + (f" ({settings_text(d)})" if d else "")
        for r, d in zip(runs, differing_settings(list(runs)), strict=True)
    ]


def comparison_figure(runs: Sequence[RunData], opts: FigureOptions | None = None) -> Figure:
    """Runs side by side: one colour per run, its train loss solid and its validation dashed; the
    key names each run with the settings that differ between them."""
    opts = opts or FigureOptions()
    with matplotlib.rc_context(RC):
        fig = Figure(figsize=(opts.width_in, opts.height_in), layout="constrained")
        ax = fig.add_subplot()
        n = len(runs)
        for i, run in enumerate(runs):
            color = series_color(i)
            # equal runs hide none of each other: the first widest, each later one over it narrower
            width = device_width(i, n, 1.4, 1.2)
            if run.train.rows and "loss" in run.train.columns:
                x, br = x_values(run, run.train, opts.x_mode), series_breaks(run, run.train)
                y = run.train.get("loss")
                _train_curve(ax, x, y, opts, br, color=color, linewidth=width, label=run.name, zorder=3 + i)
            _validation(ax, run, opts, color, f"{run.name} (validation)", width, zorder=3 + n + i)
        _finish_axes(ax, opts, "loss", log_y=opts.log_y and _positive(runs))
        _title(fig, ax, f"Loss · {len(runs)} runs compared", None, opts.smoothing)
        # one entry per run, and what solid and dashed mean once, not a validation entry per run
        handles = [Line2D([], [], color=series_color(i), linewidth=1.8) for i in range(len(runs))]
        labels = run_labels(runs)
        if any(r.eval.rows for r in runs):
            handles += [
                Line2D([], [], color="#555", linewidth=1.8),
                Line2D([], [], color="#555", linestyle=(0, (4, 2))),
            ]
            labels += ["train (solid)", "validation (dashed)"]
        if n > 1:
            handles.append(Line2D([], [], color="#555", linewidth=1.0))
            labels.append("equal lines: the first run widest")
        _legend(ax, handles, labels)
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
