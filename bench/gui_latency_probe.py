"""Where the event loop's worst moments go while a run trains: a diagnostic, not a benchmark.

Runs digits on two CPU lanes in the real window (offscreen) for a few seconds and lists, for the
latest ticks of a 10 ms timer, what the GUI thread did inside them (plot refresh, paint, records) and
any garbage collection longer than 5 ms (with its thread and CPU time). Also: paints with and without
a hold on the run, and the collector's state at the end.

    python bench/gui_latency_probe.py [--hold on|off] [--seconds 8]

With ``--export-points N`` it measures instead the same 10 ms timer while the window exports a shown
run of N logged steps (two lanes, telemetry every 10th step) as PNG and CSV: in the background (the
window's export: a process of its own, a progress bar) and, with ``--sync``, on the GUI thread as
before (the longest gap is then how long the window froze).

    python bench/gui_latency_probe.py --export-points 1000000 [--sync]
"""

from __future__ import annotations

import argparse
import gc
import os
import threading
import time

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import numpy as np
import pyqtgraph as pg
from training_window import stop, tick_gaps, training_window

T = time.perf_counter


def synthetic_run(n: int):
    """A run of ``n`` logged steps on cpu:0 and cpu:1, its columns filled at once (not record by record)."""
    from multilane.gui.runs.run_data import Column, RunData, Series

    def series(cols: dict[str, np.ndarray]) -> Series:
        s = Series()
        for k, v in cols.items():
            c = s.columns[k] = Column(0)
            c._buf, c.n = np.ascontiguousarray(v, dtype=np.float64), len(v)
        s.rows = len(next(iter(cols.values())))
        return s

    rng = np.random.default_rng(0)
    step = np.arange(1, n + 1, dtype=np.float64)
    wall = 1000.0 + 0.01 * step
    loss = 2.0 * np.exp(-step / n) + 0.05 * rng.random(n)
    run = RunData("export-probe")
    run.set_devices(["cpu:0", "cpu:1"])
    run.t0 = 1000.0
    run.train = series(
        {"step": step, "wall_time": wall, "loss": loss, "loss/cpu:0": loss, "loss/cpu:1": loss * 1.01}
        | {"lr": np.full(n, 0.01), "samples_per_s": 900 + 50 * rng.standard_normal(n)}
    )
    t = slice(None, None, 10)
    run.telemetry = series(
        {"step": step[t], "wall_time": wall[t], "util/cpu:0": 40 + rng.random(len(step[t]))}
        | {"util/cpu:1": 42 + rng.random(len(step[t])), "rss_mb": np.full(len(step[t]), 300.0)}
    )
    return run


def export_probe(points: int, sync: bool) -> None:
    """A 10 ms timer's lateness while the shown run of ``points`` steps is exported (PNG and CSV)."""
    import tempfile

    from multilane.gui.window.main_window import MainWindow
    from PySide6.QtCore import QEventLoop, QSettings, Qt, QTimer

    tmp = tempfile.mkdtemp()
    w = MainWindow(QSettings(os.path.join(tmp, "s.ini"), QSettings.IniFormat))
    w.resize(1400, 900)
    w.show()
    w.plots.reset(synthetic_run(points))
    w.plots.refresh()
    ticks: list[float] = []
    timer = QTimer()
    timer.setTimerType(Qt.PreciseTimer)
    timer.timeout.connect(lambda: ticks.append(T()))
    loop = QEventLoop()
    out = os.path.join(tmp, "out")
    t0 = T()

    def begin() -> None:
        nonlocal t0
        t0 = T()
        ticks.append(t0)
        if sync:
            w.export(out, ["png", "csv"], 1600)
            QTimer.singleShot(100, loop.quit)
        else:
            job = w.export_in_background(out, ["png", "csv"], 1600)
            job.finished.connect(lambda _r: QTimer.singleShot(100, loop.quit))

    collections: list[tuple[float, float, str]] = []  # (start, seconds, thread) of each collection over 20 ms
    gc_t0 = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_t0[0] = T()
        elif T() - gc_t0[0] > 0.02:
            collections.append(
                (gc_t0[0], T() - gc_t0[0], f"gen {info['generation']}, {threading.current_thread().name}")
            )

    gc.callbacks.append(on_gc)
    timer.start(10)
    QTimer.singleShot(200, begin)
    loop.exec()
    gc.callbacks.remove(on_gc)
    took = T() - t0
    timer.stop()
    gaps = np.diff([t for t in ticks if t >= t0]) * 1000
    late = gaps - 10
    files = sorted(os.listdir(out)) if os.path.isdir(out) else []
    where = "on the GUI thread" if sync else "in the background"
    print(
        f"export of {points:,} steps {where}: {took:.1f} s, {len(late)} ticks of a 10 ms timer meanwhile; "
        f"lateness median {np.median(late):.1f} ms, p99 {np.percentile(late, 99):.1f} ms, max {late.max():.1f} ms; "
        f"wrote {', '.join(files)}"
    )
    after = [t for t in ticks if t >= t0]
    for i in np.argsort(-late)[:3]:
        print(f"  a gap of {gaps[i]:.0f} ms, {after[i] - t0:.1f} s into the export")
    for start, secs, where in collections:
        print(f"  garbage collection at {start - t0:.1f} s: {secs * 1000:.0f} ms ({where})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hold", choices=["on", "off"], default="on")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--export-points", type=int, default=0)
    ap.add_argument("--sync", action="store_true")
    args = ap.parse_args()
    pg.mkQApp("probe")
    if args.export_points:
        export_probe(args.export_points, args.sync)
        from multilane.gui.plots.export import exit_without_qt_teardown

        exit_without_qt_teardown(0)
    from multilane.gui.plots import panel as plots_module
    from multilane.gui.window.main_window import MainWindow

    events: list[tuple[float, str, float]] = []  # (start, what, duration)
    paints: list[tuple[bool, float]] = []  # (held, duration)
    window: list[MainWindow] = []

    refresh = plots_module.PlotPanel.refresh
    paint = plots_module.PlotPanel.paintEvent

    def timed_refresh(self) -> None:
        t0, dirty = T(), self.dirty
        refresh(self)
        if dirty:
            events.append((t0, "refresh", T() - t0))

    def timed_paint(self, ev) -> None:
        w = window[0] if window else None
        held = bool(w and w.run and not w.run.control._unheld.is_set())
        t0 = T()
        paint(self, ev)
        events.append((t0, "paint", T() - t0))
        paints.append((held, T() - t0))

    plots_module.PlotPanel.refresh = timed_refresh
    plots_module.PlotPanel.paintEvent = timed_paint

    gc_start: dict[str, float] = {}

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_start["t"], gc_start["cpu"] = T(), time.thread_time()
        elif T() - gc_start["t"] > 0.005:
            cpu = (time.thread_time() - gc_start["cpu"]) * 1000
            name = f"gc{info['generation']} in {threading.current_thread().name}, cpu {cpu:.0f} ms"
            events.append((gc_start["t"], name, T() - gc_start["t"]))

    gc.callbacks.append(on_gc)
    w = training_window(args.hold == "on")
    window.append(w)
    ticks = tick_gaps(w, args.seconds)
    held = w.run.control.held_s
    stop(w)
    late = np.array([(b - a) * 1000 - 10 for a, b in ticks])
    print(
        f"hold {args.hold}: {len(late)} ticks, lateness median {np.median(late):.1f} ms, p99 "
        f"{np.percentile(late, 99):.1f} ms, max {late.max():.1f} ms; training held {held:.2f} s"
    )
    for what in ("refresh", "paint"):
        d = [e[2] * 1000 for e in events if e[1] == what]
        if d:
            print(f"  {what}: n={len(d)} median {np.median(d):.1f} ms, p90 {np.percentile(d, 90):.1f} ms")
    for h in (True, False):
        d = [p[1] * 1000 for p in paints if p[0] == h]
        if d:
            print(f"  paints {'during a hold' if h else 'without a hold'}: n={len(d)} median {np.median(d):.1f} ms")
    print("  the 8 latest ticks and what ran inside them (start ms into the tick + duration ms):")
    for i in np.argsort(-late)[:8]:
        a, b = ticks[i]
        inside = [f"{what} @{(t - a) * 1000:.0f}+{d * 1000:.0f}" for t, what, d in events if a <= t < b]
        print(f"    {late[i]:5.0f} ms: {', '.join(inside) or '(nothing of the GUI thread: it waited for the GIL)'}")
    print(f"  collector: enabled {gc.isenabled()}, frozen objects {gc.get_freeze_count():,}")
    from multilane.gui.plots.export import exit_without_qt_teardown

    exit_without_qt_teardown(0)


if __name__ == "__main__":
    main()
