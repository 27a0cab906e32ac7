"""The redraw pace: while a run trains, the plots' redraws take at most a small share of the CPU."""

from __future__ import annotations

import pytest

pytest.importorskip("PySide6")

from multilane.gui.runs.redraw_pace import MAX_REDRAW_MS, REDRAW_MS, RedrawPace
from PySide6.QtCore import Qt
from test_gui import configure


@pytest.mark.parametrize(
    "cores,cost_ms,interval_ms",
    [
        (16, 15, REDRAW_MS),  # a workstation: 15 ms redraws at 10 Hz are 0.9% of its CPU
        (2, 15, 375),  # a 2-core laptop: 15 ms / 375 ms = 4% of one core, 2% of the machine
        (2, 4, REDRAW_MS),
        (1, 100, MAX_REDRAW_MS),  # however slow, the plots move once a second
    ],
)
def test_redraws_take_at_most_two_percent_of_the_machine(cores, cost_ms, interval_ms):
    pace = RedrawPace(cores=cores)
    for _ in range(30):
        pace.add(cost_ms / 1000)
    assert pace.interval_ms() == pytest.approx(interval_ms, abs=1)


@pytest.mark.slow
def test_the_window_paces_its_redraws_while_a_run_trains_and_not_after(qtbot, window):
    window.redraw_pace = RedrawPace(cores=1, share=0.0005)  # a budget any real redraw exceeds
    configure(window, task="mlp", steps=400, log_every=2)
    qtbot.mouseClick(window.start_btn, Qt.LeftButton)
    qtbot.waitUntil(lambda: window.timer.interval() > REDRAW_MS, timeout=60_000)
    assert window.redraw_pace.cost_s > 0
    qtbot.waitUntil(lambda: not window.is_running(), timeout=120_000)
    qtbot.waitUntil(lambda: window.timer.interval() == REDRAW_MS, timeout=5_000)
