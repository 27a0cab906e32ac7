"""GUI speed: redraw time with 8 curves of 1,000,000 points each, and the event loop's latency while
a run trains. Runs offscreen (no display needed).

    python bench/gui_redraw.py [--points 1000000] [--redraws 30] [--seconds 10]

Targets on the development machine: median redraw <= 30 ms; p99 event-loop latency <= 50 ms.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import numpy as np
import pyqtgraph as pg
from training_window import stop, tick_gaps, training_window


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
    from multilane.gui.plots.panel import PlotPanel
    from multilane.gui.runs.run_data import Column

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


def loop_latency(seconds: float, hold: bool) -> tuple[list[float], dict]:
    """Lateness of a 10 ms QTimer in the real window while digits trains on two CPU lanes.
    ``hold``: training waits between steps while the plots redraw (Run > Smooth window)."""
    w = training_window(hold)
    step0 = [0]
    gaps = tick_gaps(w, seconds, on_begin=lambda: step0.__setitem__(0, w._last_train.get("step", 0)))
    train = dict(w._last_train)
    train["held_s"] = w.run.control.held_s
    train["steps_per_s"] = (train.get("step", 0) - step0[0]) / seconds
    stop(w)
    return [max(0.0, (b - a) * 1000 - 10) for a, b in gaps], train


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", type=int, default=1_000_000)
    ap.add_argument("--redraws", type=int, default=30)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    pg.mkQApp("bench")
    t = redraw_times(args.points, args.redraws)
    print(f"redraw of the plot panel, 8 device curves x {args.points:,} points, {len(t)} redraws:")
    print(
        f"  median {statistics.median(t):6.1f} ms   p90 {np.percentile(t, 90):6.1f} ms   max {max(t):6.1f} ms   (target: median <= 30 ms)"
    )
    print(
        f"\nevent loop while training digits on cpu:0,cpu:1 (lateness of a 10 ms timer, {args.seconds:.0f} s per round,"
        f" {args.rounds} rounds of each, interleaved):"
    )
    print(
        f"{'hold while redrawing':22} {'ticks':>6} {'median ms':>10} {'p99 ms':>8} {'max ms':>8} {'steps/s':>10} {'held':>6}"
    )
    results: dict[bool, list] = {False: [], True: []}
    for _ in range(args.rounds):
        for hold in (False, True):
            results[hold].append(loop_latency(args.seconds, hold))
    for hold in (False, True):
        lat = [x for r in results[hold] for x in r[0]]
        sps = statistics.median([r[1]["steps_per_s"] for r in results[hold]])
        held = sum(r[1]["held_s"] for r in results[hold]) / (args.seconds * args.rounds)
        print(
            f"{'on' if hold else 'off':22} {len(lat):6} {statistics.median(lat):10.1f} {np.percentile(lat, 99):8.1f}"
            f" {max(lat):8.1f} {sps:10,.1f} {held:6.0%}"
        )
    print("target: p99 <= 50 ms ('held': share of the time training waited for the window)")
    from multilane.gui.plots.export import exit_without_qt_teardown

    exit_without_qt_teardown(0)


if __name__ == "__main__":
    main()
