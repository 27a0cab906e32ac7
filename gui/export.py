"""Exporting plots (PNG, SVG) and metrics (CSV), from the app or headless (``multilane export``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyqtgraph as pg
from multilane.engine.errors import UserError
from multilane.engine.runlog import run_task_name
from pyqtgraph.exporters import ImageExporter
from PySide6.QtCore import QRectF, QSize
from PySide6.QtGui import QPainter
from PySide6.QtSvg import QSvgGenerator


def _writable(path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"export: cannot create {path.parent} ({e.strerror or e})") from None


def export_png(item: pg.GraphicsItem, path: str | Path, width: int = 1600) -> Path:
    """A plot (or the whole panel's layout) as a PNG ``width`` pixels wide."""
    p = Path(path)
    _writable(p)
    exporter = ImageExporter(item)
    exporter.parameters()["width"] = int(width)
    exporter.parameters()["antialias"] = True
    try:
        exporter.export(str(p))
    except OSError as e:
        raise UserError(f"export: cannot write {p} ({e.strerror or e})") from None
    if not p.exists():
        raise UserError(f"export: cannot write {p}")
    return p


def export_svg(item: pg.GraphicsItem, path: str | Path) -> Path:
    """A plot as SVG through Qt's own SVG paint engine.

    pyqtgraph 0.14.0's SVGExporter raises ValueError with PySide6 6.12 (it parses Qt's SVG output,
    whose format changed); rendering the scene into a QSvgGenerator gives vector output without it.
    """
    p = Path(path)
    _writable(p)
    rect = item.sceneBoundingRect()
    w, h = max(1, int(rect.width())), max(1, int(rect.height()))
    gen = QSvgGenerator()
    gen.setFileName(str(p))
    gen.setSize(QSize(w, h))
    gen.setViewBox(QRectF(0, 0, w, h))
    gen.setTitle("Multilane plot")
    painter = QPainter()
    if not painter.begin(gen):
        raise UserError(f"export: cannot write {p}")
    try:
        item.scene().render(painter, QRectF(0, 0, w, h), rect)
    finally:
        painter.end()
    if not p.exists() or p.stat().st_size == 0:
        raise UserError(f"export: cannot write {p}")
    return p


def export_run(
    panel, out_dir: str | Path, formats: list[str], width: int = 1600, run_dir: str | Path | None = None
) -> list[Path]:
    """Write the loss plot (PNG, SVG), every plot (``plots.png``), the CSV, and — as a bundle — the
    run's config and environment, into ``out_dir``."""
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"export: cannot create {out} ({e.strerror or e})") from None
    panel.refresh()
    written: list[Path] = []
    if "png" in formats:
        written.append(export_png(panel.loss, out / "loss.png", width))
        written.append(export_png(panel.ci, out / "plots.png", width))
    if "svg" in formats:
        written.append(export_svg(panel.loss, out / "loss.svg"))
    if "csv" in formats:
        path = out / "metrics.csv"
        try:
            panel.data.write_csv(path)
        except OSError as e:
            raise UserError(f"export: cannot write {path} ({e.strerror or e})") from None
        written.append(path)
    if run_dir is not None:
        for name in ("config.json", "environment.json", "status.json"):
            src = Path(run_dir) / name
            if src.is_file() and (out / name).resolve() != src.resolve():
                try:
                    shutil.copyfile(src, out / name)
                except OSError as e:
                    raise UserError(f"export: cannot copy {src} ({e.strerror or e})") from None
                written.append(out / name)
    return written


def export_headless(run_dir: str | Path, out_dir: str | Path, formats: list[str], width: int = 1600) -> list[Path]:
    """``multilane export``: the same images as the app, rendered offscreen."""
    import os

    from multilane.gui.run_data import RunData

    rd = Path(run_dir)
    if not (rd / "metrics.jsonl").exists():
        raise UserError(f"export: {rd} is not a run folder (no metrics.jsonl)")
    if not os.environ.get("DISPLAY") and not os.environ.get("WAYLAND_DISPLAY"):
        os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    app = pg.mkQApp("multilane-export")
    from multilane.gui.plots import PlotPanel

    panel = PlotPanel()
    panel.resize(1400, 1000)
    panel.show()  # laid out as in the app: linked axes follow by the views' geometry
    panel.reset(RunData.from_run_dir(rd))
    task = run_task_name(rd)  # None unless config.json is readable and names one
    if task is not None:
        panel.header.setText(f"{rd.name} — task {task[:200]}", size="9pt")
    for _ in range(3):
        app.processEvents()
    return export_run(panel, out_dir, formats, width, run_dir=rd)


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
