"""Exporting a run: figures (PNG, SVG, PDF, through matplotlib), metrics (CSV) and, as a bundle, the
run's config and environment. From the app or headless (``multilane export``); no Qt here."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

from multilane.engine.errors import UserError
from multilane.gui.plots.figures import FigureOptions, comparison_figure, loss_figure, run_caption, save_figure
from multilane.gui.plots.overview import comparison_overview_figure, overview_figure
from multilane.gui.runs.run_data import RunData, read_request

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
    progress: Callable[[int, int, str], None] | None = None,
) -> list[Path]:
    """Write into ``out_dir``: ``loss.*`` (every device, combined, validation), ``compare.*`` when other
    runs are compared (one loss curve per run), ``plots.*`` (every plot; compared, every plot per
    run), ``metrics.csv``; with ``bundle``,
    the run's config, environment and status too. ``width`` is the PNG's width in pixels.
    ``progress(done, total, what)`` is called before each part (a figure in one format, the CSV)."""
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"export: cannot create {out} ({e.strerror or e})") from None
    opts = options or FigureOptions()
    caption = run_caption(run_dir) if run_dir is not None else None
    if caption is not None and (noise := run.noise_summary()) is not None:
        caption += f" · {noise}"  # the noise scale, its unit and band, as the view and watch print it
    images = [f for f in formats if f in FORMATS and f != "csv"]
    figures = [
        ("loss", lambda: loss_figure(run, opts, caption)),
        *([("compare", lambda: comparison_figure([run, *compare], opts))] if compare else []),
        # every panel: of this run, or of the runs compared (each run in its colour in every panel)
        (
            "plots",
            lambda: (
                comparison_overview_figure([run, *compare], opts) if compare else overview_figure(run, opts, caption)
            ),
        ),
    ]
    total = len(figures) * len(images) + ("csv" in formats) + bool(bundle and run_dir is not None)
    done = 0

    def tick(what: str) -> None:
        nonlocal done
        if progress is not None:
            progress(done, total, what)
        done += 1

    written: list[Path] = []
    for stem, make in figures if images else []:
        fig = make()
        for fmt in images:
            tick(f"{stem}.{fmt}")
            written += save_figure(fig, out / stem, [fmt], width, opts)
    if "csv" in formats:
        tick("metrics.csv")
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
        tick("config, environment, status")
        for name in ("config.json", "environment.json", "status.json"):
            src = Path(run_dir) / name
            if src.is_file() and (out / name).resolve() != src.resolve():
                try:
                    shutil.copyfile(src, out / name)
                except OSError as e:
                    raise UserError(f"export: cannot copy {src} ({e.strerror or e})") from None
                written.append(out / name)
    if progress is not None:
        progress(total, total, "done")
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


def export_child_main(request_path: str) -> int:
    """The app's export in a process of its own (``gui/export/export_job.py``): matplotlib's drawing of a
    million points holds the GIL for seconds, and in the app's process the window stopped answering.
    Prints one JSON line per part (``{"progress": [done, total, what]}``), then ``{"done": [paths]}`` or
    ``{"error": text}``. The request is a file the app wrote a moment before into its own temporary
    folder (``write_request``), never one from elsewhere."""

    def say(**msg) -> None:
        print(json.dumps(msg), flush=True)

    try:
        r = read_request(request_path)  # no matplotlib in that module: the window imports it
        paths = export_run(
            r["run"],
            r["out_dir"],
            r["formats"],
            r["width"],
            run_dir=r["run_dir"],
            compare=r["compare"],
            options=FigureOptions(**r["options"]),
            bundle=r["bundle"],
            progress=lambda done, total, what: say(progress=[done, total, what]),
        )
        say(done=[str(p) for p in paths])
    except UserError as e:
        say(error=str(e))
    except Exception as e:  # a figure matplotlib cannot draw: one line, never a traceback in the window
        say(error=f"export failed: {type(e).__name__}: {e}")
    return 0


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
