"""What a repaint of the app's six plots costs, and what its grid costs: a finished digits run is
opened in the real window (offscreen) and the plot panel repainted synchronously, with the app's
grid (opaque, light grey, major ticks), pyqtgraph's default translucent grid, and no grid.

    python bench/gui_paint.py [--steps 600] [--repaints 15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pyqtgraph as pg
from PySide6.QtCore import QSettings


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--repaints", type=int, default=15)
    args = ap.parse_args()
    app = pg.mkQApp("bench")
    from multilane.engine.config import build_config
    from multilane.engine.run.trainer import Trainer
    from multilane.gui.plots.style import GRID_COLOR
    from multilane.gui.window.main_window import MainWindow

    tmp = tempfile.mkdtemp()
    raw = {"devices": {"use": "cpu:0,cpu:1"}, "train": {"steps": args.steps, "log_every": 5}, "run": {"runs_dir": tmp}}
    run_dir = Trainer(build_config(raw, "bench")).run().run_dir
    w = MainWindow(QSettings(os.path.join(tmp, "s.ini"), QSettings.IniFormat))
    w.resize(1400, 900)
    w.show()
    w.smooth.setValue(50)
    w.open_run(str(run_dir))
    axes = [p.getAxis(a) for p in w.plots.plots for a in ("left", "bottom")]

    def grid(alpha, level: int, color: str, tick_alpha) -> None:
        for ax in axes:
            ax.setStyle(tickAlpha=tick_alpha, maxTickLevel=level)
            ax.setTickPen(pg.mkPen(color))
            ax.setGrid(alpha)
            ax.picture = None
            ax.update()
        for _ in range(5):
            app.processEvents()

    def timed() -> float:
        times = []
        for _ in range(args.repaints):
            t0 = time.perf_counter()
            w.plots.viewport().repaint()
            times.append((time.perf_counter() - t0) * 1000)
        return statistics.median(times)

    print(
        f"synchronous repaint of the six plots ({args.steps} steps of digits, 1400x900 window), median of {args.repaints}:"
    )
    rows = []
    for _ in range(2):  # two passes, alternating, so drift lands on all alike
        grid(255, 0, GRID_COLOR, 255)
        rows.append(("app: opaque light grid, major ticks", timed()))
        grid(int(0.2 * 255), 1, "#333", None)
        rows.append(("pyqtgraph default: translucent grid (alpha 0.2)", timed()))
        grid(False, 1, GRID_COLOR, 255)
        rows.append(("no grid", timed()))
    for name in dict.fromkeys(n for n, _ in rows):
        best = min(t for n, t in rows if n == name)
        print(f"  {name:50} {best:6.1f} ms")
    from multilane.gui.plots.export import exit_without_qt_teardown

    exit_without_qt_teardown(0)


if __name__ == "__main__":
    main()
