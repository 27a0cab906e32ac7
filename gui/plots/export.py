"""Exporting a run: figures (PNG, SVG, PDF, through matplotlib), metrics (CSV) and, as a bundle, the
run's config and environment. From the app or headless (``multilane export``); no Qt here."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

from multilane.engine.errors import UserError
from multilane.gui.plots.figures import FigureOptions, comparison_figure, loss_figure, run_caption, save_figure
from multilane.gui.plots.overview import comparison_overview_figure, overview_figure
from multilane.gui.runs.run_data import RunData

FORMATS = ("png", "svg", "pdf", "csv")
DEFAULT_FORMATS = ["png", "svg", "pdf", "csv"]


def export_run(
    run: RunData,
    out_dir: str | Path,
    formats: Sequence[str],
    width: int = 1600,
    run_dir: str | Path | None = None,
    compare: Sequence[RunData] = (),
    options: FigureOptions | None = None,
    bundle: bool = False,
) -> list[Path]:
    """Write into ``out_dir``: ``loss.*`` (every device, combined, validation), ``compare.*`` when other
    runs are compared (one loss curve per run), ``plots.*`` (every plot; compared, every plot per
    run), ``metrics.csv``; with ``bundle``,
    the run's config, environment and status too. ``width`` is the PNG's width in pixels."""
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"export: cannot create {out} ({e.strerror or e})") from None
    opts = options or FigureOptions()
    caption = run_caption(run_dir) if run_dir is not None else None
    images = [f for f in formats if f != "csv"]
    written: list[Path] = []
    if images:
        written += save_figure(loss_figure(run, opts, caption), out / "loss", images, width, opts)
        if compare:
            fig = comparison_figure([run, *compare], opts)
            written += save_figure(fig, out / "compare", images, width, opts)
        # every panel: of this run, or of the runs compared (each run in its colour in every panel)
        plots = comparison_overview_figure([run, *compare], opts) if compare else overview_figure(run, opts, caption)
        written += save_figure(plots, out / "plots", images, width, opts)
    if "csv" in formats:
        path = out / "metrics.csv"
        try:
            run.write_csv(path)
            if run.health or run.noise.rows:
                health = out / "health.csv"
                run.write_health_csv(health)
                written.append(health)
        except OSError as e:
            raise UserError(f"export: cannot write {path} ({e.strerror or e})") from None
        written.append(path)
    if bundle and run_dir is not None:
        for name in ("config.json", "environment.json", "status.json"):
            src = Path(run_dir) / name
            if src.is_file() and (out / name).resolve() != src.resolve():
                try:
                    shutil.copyfile(src, out / name)
                except OSError as e:
                    raise UserError(f"export: cannot copy {src} ({e.strerror or e})") from None
                written.append(out / name)
    return written


def export_headless(
    run_dir: str | Path, out_dir: str | Path, formats: Sequence[str], width: int = 1600, **options
) -> list[Path]:
    """``multilane export``: the app's figures and CSV from a run folder, without Qt or a display."""
    rd = Path(run_dir)
    if not (rd / "metrics.jsonl").exists():
        raise UserError(f"export: {rd} is not a run folder (no metrics.jsonl)")
    compare = [RunData.from_run_dir(p) for p in options.pop("compare", [])]
    run = RunData.from_run_dir(rd)
    return export_run(run, out_dir, formats, width, run_dir=rd, compare=compare, options=FigureOptions(**options))


def exit_without_qt_teardown(code: int = 0) -> None:
    """End the process now, skipping Python's destruction of Qt objects.

    PySide6 6.11 with torch loaded can crash while the interpreter tears widgets down at exit, after
    all work is done. Files are closed and output flushed first.
    """
    import os
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
