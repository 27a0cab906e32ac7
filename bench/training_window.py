"""Shared by the GUI benchmarks: the real window (offscreen) training digits on two CPU lanes, and the
gaps between the ticks of a 10 ms timer in its event loop."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pyqtgraph as pg
from PySide6.QtCore import QEventLoop, QSettings, Qt, QTimer


def training_window(hold: bool):
    """A shown MainWindow set up for a long digits run on cpu:0,cpu:1 (smoothing on, log every 5)."""
    from multilane.gui.window.main_window import MainWindow

    tmp = tempfile.mkdtemp()
    w = MainWindow(QSettings(os.path.join(tmp, "s.ini"), QSettings.IniFormat))
    w.hold_action.setChecked(hold)
    w.form.editors["run.runs_dir"].widget.setText(os.path.join(tmp, "runs"))
    w.form.editors["train.epochs"].widget.setValue(1000)
    w.form.editors["train.log_every"].widget.setValue(5)
    w.devices.set_checked(["cpu:0", "cpu:1"])
    w.smooth.setValue(50)
    w.resize(1400, 900)
    w.show()
    return w


def tick_gaps(w, seconds: float, on_begin: Callable[[], None] | None = None) -> list[tuple[float, float]]:
    """Start the window's run, and from 1 s later (set-up included) for ``seconds``, the (previous, this)
    times of every tick of a 10 ms timer, the window's event loop running as in the app."""
    gaps: list[tuple[float, float]] = []
    last = [time.perf_counter()]

    def tick() -> None:
        now = time.perf_counter()
        gaps.append((last[0], now))
        last[0] = now

    def begin() -> None:
        if on_begin is not None:
            on_begin()
        last[0] = time.perf_counter()
        timer.start(10)

    timer = QTimer()
    timer.setTimerType(Qt.PreciseTimer)
    timer.timeout.connect(tick)
    loop = QEventLoop()
    w.start()
    QTimer.singleShot(1000, begin)
    QTimer.singleShot(int((seconds + 1) * 1000), loop.quit)
    loop.exec()
    timer.stop()
    return gaps


def stop(w) -> None:
    """Stop the run, wait for it, close the window."""
    w.stop()
    while w.is_running():
        pg.mkQApp().processEvents()
        time.sleep(0.01)
    w.close()
