"""A sweep's figures, for the live tab and for papers: parallel coordinates (one line a trial, one axis a
parameter and the objective, the best trial marked) and parameter importances (Optuna's fANOVA-free
default, ``optuna.importance``). The numbers come from here; the tab draws them with pyqtgraph, the
export with matplotlib (PNG, SVG, PDF with real text, as the loss export). No Qt here."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from multilane.engine.sweep.optuna_lib import optuna
from multilane.engine.sweep.rows import rows_csv, trial_rows

BEST = "#000000"
PRUNED = "#BBBBBB"


@dataclass
class Coordinates:
    """Parallel coordinates: axis names, each trial's position on every axis in 0..1, the ticks of each axis."""

    axes: list[str]
    lines: list[tuple[int, list[float], float | None, str]] = field(default_factory=list)  # number, ys, value, state
    ticks: list[list[tuple[float, str]]] = field(default_factory=list)
    best: int | None = None


def coordinates(study: Any, keys: list[str], log_keys: set[str], objective: str) -> Coordinates:
    """Every finished trial (complete or pruned) placed on the parameter axes and the objective axis."""
    rows = [r for r in trial_rows(study) if r["state"] in ("complete", "pruned") and r["value"] is not None]
    c = Coordinates([*keys, objective])
    cols: list[list[Any]] = [[r["params"].get(k) for r in rows] for k in keys] + [[r["value"] for r in rows]]
    scales = []
    for name, col in zip(c.axes, cols, strict=True):
        numbers = [v for v in col if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if numbers and len(numbers) == len(col):
            log = name in log_keys and min(numbers) > 0
            f = (lambda v: math.log10(v)) if log else (lambda v: float(v))
            lo, hi = min(map(f, numbers)), max(map(f, numbers))
            span = hi - lo or 1.0
            scales.append(lambda v, f=f, lo=lo, span=span: (f(v) - lo) / span)
            ticks = [(0.0, _fmt(min(numbers))), (1.0, _fmt(max(numbers)))] if numbers else []
        else:
            cats = sorted({str(v) for v in col})
            n = max(1, len(cats) - 1)
            scales.append(lambda v, cats=cats, n=n: cats.index(str(v)) / n if len(cats) > 1 else 0.5)
            ticks = [(i / n if len(cats) > 1 else 0.5, cat) for i, cat in enumerate(cats)]
        c.ticks.append(ticks)
    for i, r in enumerate(rows):
        c.lines.append(
            (r["number"], [scale(col[i]) for scale, col in zip(scales, cols, strict=True)], r["value"], r["state"])
        )
        if r["is_best"]:
            c.best = r["number"]
    return c


def importances(study: Any) -> dict[str, float]:
    """Each parameter's share of the objective's variance (Optuna's default evaluator); empty until enough
    trials have finished (two at least, with different values)."""
    mod = optuna()
    done = [t for t in study.get_trials(deepcopy=False) if t.state == mod.trial.TrialState.COMPLETE]
    if len(done) < 2 or len({t.value for t in done}) < 2:
        return {}
    try:
        return dict(mod.importance.get_param_importances(study))
    except (ValueError, RuntimeError):  # a space with no variance yet
        return {}


def sweep_figure(study: Any, keys: list[str], log_keys: set[str], objective: str, maximize: bool = False) -> Any:
    """Parallel coordinates and importances side by side, a matplotlib Figure."""
    import matplotlib
    from matplotlib.figure import Figure
    from multilane.gui.plots.figures import RC

    c = coordinates(study, keys, log_keys, objective)
    imp = importances(study)
    with matplotlib.rc_context(RC):
        fig = Figure(figsize=(9.0, 3.6), layout="constrained")
        ax, bx = fig.subplots(1, 2, width_ratios=[3, 1.3])
        values = [v for _, _, v, s in c.lines if s == "complete" and v is not None]
        cmap = matplotlib.colormaps["viridis_r" if not maximize else "viridis"]
        lo, hi = (min(values), max(values)) if values else (0.0, 1.0)
        xs = list(range(len(c.axes)))
        for number, ys, v, state in sorted(c.lines, key=lambda x: x[0] == c.best):
            if number == c.best:
                ax.plot(xs, ys, color=BEST, lw=2.6, zorder=3)
            elif state == "pruned":
                ax.plot(xs, ys, color=PRUNED, lw=0.9, ls="--", zorder=1)
            else:
                ax.plot(xs, ys, color=cmap((v - lo) / ((hi - lo) or 1.0)), lw=1.3, zorder=2)
        for x, ticks in zip(xs, c.ticks, strict=True):
            ax.axvline(x, color="#888888", lw=0.8, zorder=0)
            for y, text in ticks:
                ax.annotate(text, (x, y), xytext=(4, 0), textcoords="offset points", fontsize=7, va="center", zorder=4,
                            bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.85})  # fmt: skip
        ax.set_xticks(xs, [_short(a) for a in c.axes])
        ax.set_yticks([])
        ax.set_ylim(-0.05, 1.05)
        ax.grid(False)
        best = f"; best: trial {c.best}, thick black" if c.best is not None else ""
        ax.set_title(f"Trials (pruned dashed{best})")
        names = list(imp)[::-1]
        bx.barh([_short(n) for n in names], [imp[n] for n in names], color="#332288")
        bx.set_xlim(0, 1)
        bx.set_title("Parameter importance")
        if not imp:
            bx.text(
                0.5, 0.5, "after two finished trials", ha="center", va="center", transform=bx.transAxes, color="#777777"
            )
    return fig


def export_sweep(study: Any, keys: list[str], log_keys: set[str], objective: str, out: str | Path,
                 formats: list[str], width_px: int = 1600, maximize: bool = False) -> list[Path]:  # fmt: skip
    """``sweep.png``/``.svg``/``.pdf`` and ``trials.csv`` in ``out``."""
    from multilane.gui.plots.figures import FigureOptions, save_figure

    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    if "csv" in formats:
        written.append(rows_csv(trial_rows(study), folder / "trials.csv"))
    figs = [f for f in formats if f != "csv"]
    if figs:
        fig = sweep_figure(study, keys, log_keys, objective, maximize)
        written += save_figure(fig, folder / "sweep", figs, width_px, FigureOptions(width_in=9.0, height_in=3.6))
    return written


def _short(name: str) -> str:
    return name.removeprefix("task.params.")


def _fmt(v: float) -> str:
    return f"{v:.3g}"
