"""Compare hides nothing (issue 35): a run whose values equal another's stays visible in every panel, in
the app (what is painted) and in the exported plots.png; the step-time panel names the runs, not the
phases; the hover names every run with its value."""

import numpy as np
import pytest

pytest.importorskip("PySide6")

from matplotlib.backends.backend_agg import FigureCanvasAgg
from multilane.gui.plots.overview import comparison_overview_figure
from multilane.gui.plots.palette import series_color
from PySide6.QtGui import QColor, QImage
from test_plots_truth import make_run, show


@pytest.fixture
def panel(qtbot):
    from multilane.gui.plots.panel import PlotPanel

    p = PlotPanel()
    qtbot.addWidget(p)
    p.resize(1280, 900)
    p.show()
    qtbot.waitExposed(p)
    return p


def colour_pixels(rgb: np.ndarray, color: str, tol: int = 40) -> int:
    c = QColor(color)
    want = np.array([c.red(), c.green(), c.blue()])
    return int((np.abs(rgb[..., :3].astype(int) - want).max(axis=-1) <= tol).sum())


def painted(panel, plot) -> np.ndarray:
    """What the screen shows of one plot's view box, as an RGB array."""
    rect = plot.vb.sceneBoundingRect().toRect()
    image = panel.grab(rect).toImage().convertToFormat(QImage.Format.Format_RGB32)
    w, h = image.width(), image.height()
    buf = np.frombuffer(image.constBits(), dtype=np.uint8, count=image.sizeInBytes()).reshape(h, image.bytesPerLine())
    return buf[:, : 4 * w].reshape(h, w, 4)[..., [2, 1, 0]]


def twins():
    """Two runs with every value equal: only their names differ."""
    return make_run(n=120, evals=(600, 1200), name="run-a"), make_run(n=120, evals=(600, 1200), name="run-b")


def test_equal_runs_both_show_in_every_compared_panel(panel, qtbot):
    a, b = twins()
    show(panel, a, qtbot)
    panel.add_overlay(b)
    panel.refresh()
    qtbot.wait(50)
    for what, plot in (("loss", panel.loss), ("mem", panel.memory), ("util", panel.util), ("step", panel.phases)):
        first, second = panel._curves[f"cmp0:{what}"], panel._curves[f"cmp1:{what}"]
        assert first.isVisible() and second.isVisible(), what
        # the later run drawn over the first, narrower: the first's colour shows along both edges
        assert second.zValue() > first.zValue(), what
        assert second.opts["pen"].widthF() < first.opts["pen"].widthF(), what
        rgb = painted(panel, plot)
        assert colour_pixels(rgb, series_color(0)) > 50, what  # run a under run b: still painted
        assert colour_pixels(rgb, series_color(1)) > 50, what


def test_the_step_time_key_names_the_runs_and_the_hover_names_every_run(panel, qtbot):
    a, b = twins()
    show(panel, a, qtbot)
    assert "forward" in panel.phases.titleLabel.text  # one run: the phases' key
    panel.add_overlay(b)
    panel.refresh()
    title = panel.phases.titleLabel.text
    assert "run-a" in title and "run-b" in title and "forward" not in title and "backward" not in title
    text = panel.show_values_at(600)
    for name in ("run-a", "run-b"):
        part = next(p for p in text.split(" · ") if p.startswith(f"{name}: "))
        assert "loss " in part and "memory 300.0 MiB" in part and "utilization 50%" in part, part
        assert "step time 8.0000 ms" in part, part
    assert f'color:{series_color(1)};">run-b:' in panel.header.text  # in the run's colour
    panel.reset(a)  # one run again: the phases' key comes back
    assert "forward" in panel.phases.titleLabel.text


@pytest.mark.slow
def test_the_exported_comparison_shows_equal_runs_both():
    a, b = twins()
    fig = comparison_overview_figure([a, b])
    FigureCanvasAgg(fig).draw()
    rgb = np.asarray(fig.canvas.buffer_rgba())[..., :3]
    h = rgb.shape[0]
    titles = {ax.get_title(loc="left"): ax for ax in fig.axes}
    for title in ("Loss", "Memory", "Utilization (mean over devices)", "Step time (each run's total)"):
        x0, y0, x1, y1 = titles[title].get_window_extent().extents.astype(int)
        box = rgb[h - y1 : h - y0, x0:x1]
        assert colour_pixels(box, series_color(0)) > 30, title
        assert colour_pixels(box, series_color(1)) > 30, title
