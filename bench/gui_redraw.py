"""GUI speed: redraw time with 8 curves of 1,000,000 points each, and the event loop's latency while
a run trains. Runs offscreen (no display needed).

    python bench/gui_redraw.py [--points 1000000] [--redraws 30] [--seconds 10]

Targets on the development machine: median redraw <= 30 ms; p99 event-loop latency <= 50 ms.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QSettings, QTimer


def paint(widget) -> None:
    """A synchronous paint of the whole scene into an image of the widget's size.

    (QWidget.grab() crashed with PySide6 6.11 once torch was imported; rendering the scene does not.)
    """
    from PySide6.QtGui import QImage, QPainter

    img = QImage(widget.width(), widget.height(), QImage.Format_ARGB32_Premultiplied)
    img.fill(0xFFFFFFFF)
    painter = QPainter(img)
    widget.scene().render(painter)
    painter.end()


def redraw_times(points: int, redraws: int) -> list[float]:
    """One full redraw of the app's plot panel holding 8 device loss curves of ``points`` points:
    a new record appended to every curve, the panel refreshed, the widget painted."""
    from multilane.gui.plots import PlotPanel
    from multilane.gui.run_data import Column

    panel = PlotPanel()
    panel.resize(1400, 900)
    rng = np.random.default_rng(0)
    devices = [f"cuda:{i}" for i in range(8)]
    series = panel.data.train

    def column(values: np.ndarray) -> Column:
        c = Column(capacity=2 * points)
        c._buf[:points] = values
        c.n = points
        return c

    series.columns["step"] = column(np.arange(1, points + 1, dtype=np.float64))
    series.columns["wall_time"] = column(np.arange(points, dtype=np.float64) * 0.01)
    for i, d in enumerate(devices):
        series.columns[f"loss/{d}"] = column(np.abs(np.cumsum(rng.standard_normal(points))) / 100 + i)
    series.rows = points
    panel.data.devices = devices
    panel.data.t0 = 0.0
    panel.show()
    times = []
    for k in range(redraws + 3):
        t0 = time.perf_counter()
        step = points + k + 1
        series.add({"step": step, "wall_time": step * 0.01, **{f"loss/{d}": 1.0 + i for i, d in enumerate(devices)}})
        panel._dirty = True
        panel.refresh()
        paint(panel)
        if k >= 3:  # the first refreshes build the decimation pyramids
            times.append((time.perf_counter() - t0) * 1000)
    panel.close()
    return times


def loop_latency(seconds: float) -> tuple[list[float], dict]:
    """Lateness of a 10 ms QTimer in the real window while digits trains on two CPU lanes."""
    from multilane.gui.main_window import MainWindow

    tmp = tempfile.mkdtemp()
    w = MainWindow(QSettings(os.path.join(tmp, "s.ini"), QSettings.IniFormat))
    w.form.editors["run.runs_dir"].widget.setText(os.path.join(tmp, "runs"))
    w.form.editors["train.epochs"].widget.setValue(1000)
    w.form.editors["train.log_every"].widget.setValue(5)
    w.devices.set_checked(["cpu:0", "cpu:1"])
    w.smooth.setValue(50)
    w.resize(1400, 900)
    w.show()
    app = pg.mkQApp()
    lateness: list[float] = []
    last = [time.perf_counter()]

    def tick() -> None:
        now = time.perf_counter()
        lateness.append(max(0.0, (now - last[0]) * 1000 - 10))
        last[0] = now

    timer = QTimer()
    timer.timeout.connect(tick)
    w.start()
    timer.start(10)
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        app.processEvents()
        time.sleep(0.001)
    timer.stop()
    train = w._last_train
    w.stop()
    while w.is_running():
        app.processEvents()
        time.sleep(0.01)
    w.close()
    return lateness, train


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", type=int, default=1_000_000)
    ap.add_argument("--redraws", type=int, default=30)
    ap.add_argument("--seconds", type=float, default=10.0)
    args = ap.parse_args()
    pg.mkQApp("bench")
    t = redraw_times(args.points, args.redraws)
    print(f"redraw of the plot panel, 8 device curves x {args.points:,} points, {len(t)} redraws:")
    print(
        f"  median {statistics.median(t):6.1f} ms   p90 {np.percentile(t, 90):6.1f} ms   max {max(t):6.1f} ms   (target: median <= 30 ms)"
    )
    lat, train = loop_latency(args.seconds)
    print(
        f"event loop while training digits on cpu:0,cpu:1 for {args.seconds:.0f} s ({len(lat)} ticks of a 10 ms timer):"
    )
    print(
        f"  lateness median {statistics.median(lat):5.1f} ms   p99 {np.percentile(lat, 99):5.1f} ms   max {max(lat):5.1f} ms   (target: p99 <= 50 ms)"
    )
    if train:
        print(f"  training meanwhile: step {train['step']}, {train.get('samples_per_s') or 0:,.0f} samples/s")
    from multilane.gui.export import exit_without_qt_teardown

    exit_without_qt_teardown(0)


if __name__ == "__main__":
    main()
