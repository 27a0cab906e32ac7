"""Curves that never lie: what the live plots DRAW (read back from the pyqtgraph items and the rendered
widget), compared with the samples a run logged."""

import numpy as np
import pytest

pytest.importorskip("PySide6")

import itertools

from multilane.gui.plots.palette import series_color
from multilane.gui.runs.run_data import RunData
from PySide6.QtCore import QPointF, Qt
from PySide6.QtGui import QColor


def make_run(n=600, every=10, devices=("cpu:0", "cpu:1"), seed=0, pause_at=None, pause_s=40.0, evals=(), name="run"):
    """A run as a trainer logs it: train records every ``every`` steps, telemetry beside them."""
    rng = np.random.default_rng(seed)
    d = RunData(name)
    t = 1000.0
    d.add({"kind": "event", "event": "started", "step": 0, "wall_time": t})
    for k in range(1, n + 1):
        s = k * every
        t += 0.1
        if pause_at is not None and s == pause_at:
            d.add({"kind": "event", "event": "paused", "step": s - every, "wall_time": t})
            t += pause_s
            d.add({"kind": "event", "event": "resumed", "step": s - every, "wall_time": t})
        loss = 2.0 * np.exp(-s / 1000) + 0.05
        rec = {"kind": "train", "step": s, "wall_time": t, "loss": loss, "lr": 0.01}
        rec["device_loss"] = {dev: loss for dev in devices}  # equal lanes: the hard case for visibility
        rec["samples_per_s"] = 1000 + 150 * rng.standard_normal()
        rec["phase_ms"] = {"forward": 3.0, "backward": 5.0}
        d.add(rec)
        if s in evals:
            d.add({"kind": "eval", "step": s, "wall_time": t, "val_loss": loss, "metrics": {"accuracy": 0.9}})
        tele = {dev: {"busy_pct": {"mean": 50.0}} for dev in devices}
        d.add({"kind": "telemetry", "step": s, "wall_time": t, "devices": tele, "process": {"rss_mb": 300.0}})
    return d


@pytest.fixture
def panel(qtbot):
    from multilane.gui.plots.panel import PlotPanel

    p = PlotPanel()
    qtbot.addWidget(p)
    p.resize(1280, 800)
    p.show()
    qtbot.waitExposed(p)
    return p


def show(panel, data, qtbot):
    panel.reset(data)
    panel.refresh()
    qtbot.wait(50)  # the layout gives every view its size
    panel._dirty = True
    panel.refresh()
    return panel


def drawn(item):
    x, y = item.getData()
    return np.asarray(x, float), np.asarray(y, float)


def columns_of(x, lo, hi, width):
    return np.floor((x - lo) / (hi - lo) * width).astype(int)


def assert_drawn_is_true(item, x, y, lo, hi, width):
    """Every drawn point is a logged sample, in time order, and every pixel column of the view shows
    the highest and the lowest sample that falls in it (within one column where blocks are reduced)."""
    dx, dy = drawn(item)
    fin = np.isfinite(dy)
    dx, dy = dx[fin], dy[fin]
    assert len(dx) and np.all(np.diff(dx) >= 0)  # time order: never a point drawn back in time
    pos = np.searchsorted(x, dx)
    assert np.array_equal(x[pos], dx) and np.array_equal(y[pos], dy)  # each one a real sample
    inview = (x >= lo) & (x <= hi)
    rx, ry = x[inview], y[inview]
    rcol, dcol = columns_of(rx, lo, hi, width), columns_of(dx, lo, hi, width)
    misses = 0
    for c in np.unique(rcol):
        raw = ry[rcol == c]
        near = dy[np.abs(dcol - c) <= 1]
        here = dy[dcol == c]
        assert near.max() >= raw.max() and near.min() <= raw.min()  # no extreme lost
        misses += not (len(here) and here.max() == raw.max() and here.min() == raw.min())
    assert misses <= 0.05 * len(
        np.unique(rcol)
    )  # blocks of at most a quarter column: an extreme may sit in the next one


@pytest.mark.slow
@pytest.mark.parametrize("n", [600, 20_000, 300_000])
def test_the_drawn_throughput_holds_every_pixel_columns_extremes_at_every_zoom(panel, qtbot, n):
    data = make_run(n=n, every=1 if n > 600 else 10)
    show(panel, data, qtbot)
    tr = data.train
    x, y = tr.get("step"), tr.get("samples_per_s")
    item = panel._curves["samples_per_s"]
    vb = item.getViewBox()
    for frac in (1.0, 0.2, 0.013):  # everything, then zoomed in twice
        lo = x[0]
        hi = x[0] + frac * (x[-1] - x[0])
        panel.throughput.setXRange(lo, hi, padding=0)
        panel._dirty = True
        panel.refresh()
        lo, hi = vb.viewRange()[0]
        assert_drawn_is_true(item, x, y, lo, hi, vb.width())


def test_device_lines_stay_visible_under_the_combined_line(panel, qtbot):
    """Equal lanes: each device's colour must still show on the loss plot, around the combined line."""
    show(panel, make_run(n=300), qtbot)
    image = panel.grab().toImage()
    rect = panel.loss.vb.sceneBoundingRect().toRect()
    counts = count_colours(image, rect, [series_color(0), series_color(1)])
    assert counts[0] > 150 and counts[1] > 150, counts


def count_colours(image, rect, colours, tol=40):
    arr = np.frombuffer(image.constBits(), np.uint8).reshape(image.height(), image.bytesPerLine() // 4, 4)
    arr = arr[rect.top() : rect.bottom(), rect.left() : rect.right(), :3].astype(int)  # BGR
    out = []
    for c in colours:
        q = QColor(c)
        want = np.array([q.blue(), q.green(), q.red()])
        out.append(int((np.abs(arr - want).sum(axis=2) < tol).sum()))
    return out


def test_a_pause_breaks_every_line_on_the_time_axis_and_is_marked_on_both(panel, qtbot):
    import pyqtgraph as pg

    data = make_run(n=300, pause_at=1500, evals=(500, 1000, 2000, 2500))
    panel.set_x_mode("time")
    show(panel, data, qtbot)
    t0 = data.t0
    pause = next(e for e in data.events if e["event"] == "paused")["wall_time"] - t0
    resume = next(e for e in data.events if e["event"] == "resumed")["wall_time"] - t0
    for key in ("samples_per_s", "loss", "loss/cpu:0", "util/cpu:0", "rss", "val", "metric/accuracy", "stack0"):
        dx, dy = drawn(panel._curves[key] if key in panel._curves else panel._stack[0])
        for a, b, ya, yb in zip(dx[:-1], dx[1:], dy[:-1], dy[1:], strict=True):
            # no segment drawn from before the pause to after it
            assert not (a <= pause and b >= resume and np.isfinite(ya) and np.isfinite(yb)), key
    bands = [i for i in panel.throughput.items if isinstance(i, pg.LinearRegionItem)]
    assert len(bands) == 1 and bands[0].getRegion() == pytest.approx((pause, resume), abs=0.05)
    panel.set_x_mode("step")
    panel.refresh()
    lines = [i for i in panel.throughput.items if isinstance(i, pg.InfiniteLine) and i.value() == 1490]
    assert len(lines) == 1


def test_a_stop_and_a_resume_break_the_lines_and_are_marked(panel, qtbot):
    import pyqtgraph as pg

    data = make_run(n=100)
    last = data.train.get("wall_time")[-1]
    data.add({"kind": "event", "event": "stopped", "step": 1000, "wall_time": last + 0.1})
    data.add({"kind": "event", "event": "started", "step": 1000, "resumed_from_step": 1000, "wall_time": last + 40})
    for k in range(1, 50):
        s, t = 1000 + 10 * k, last + 40 + 0.1 * k
        data.add({"kind": "train", "step": s, "wall_time": t, "loss": 0.5, "samples_per_s": 3000.0})
    panel.set_x_mode("time")
    show(panel, data, qtbot)
    dx, dy = drawn(panel._curves["samples_per_s"])
    gap = np.flatnonzero(~np.isfinite(dy))
    assert len(gap) == 1 and dx[gap[0] - 1] < 20 and dx[gap[0] + 1] > 40  # broken across the 40 s
    assert len([i for i in panel.throughput.items if isinstance(i, pg.LinearRegionItem)]) == 1
    panel.set_x_mode("step")
    panel.refresh()
    marks = [i for i in panel.loss.items if isinstance(i, pg.InfiniteLine) and i.value() == 1000]
    assert len(marks) == 1 and "resumed" in marks[0].toolTip()


def test_a_single_logged_point_is_drawn_with_a_marker(panel, qtbot):
    data = RunData("one")
    data.add({"kind": "train", "step": 5, "wall_time": 1.0, "loss": 3.0, "samples_per_s": 10.0})
    data.add({"kind": "eval", "step": 5, "wall_time": 1.0, "val_loss": 3.1, "metrics": {"bits_per_byte": 4.2}})
    show(panel, data, qtbot)
    for key in ("loss", "samples_per_s", "metric/bits_per_byte", "val"):
        assert panel._curves[key].opts["symbol"] is not None, key
    data.add({"kind": "train", "step": 10, "wall_time": 2.0, "loss": 2.0, "samples_per_s": 11.0})
    panel._dirty = True
    panel.refresh()
    assert panel._curves["samples_per_s"].opts["symbol"] is None  # two points: a line


def test_log_y_tick_labels_never_overlap(panel, qtbot):
    from PySide6.QtGui import QImage, QPainter

    data = RunData("log")
    for s in range(1, 400):
        loss = 0.3 * np.exp(-s / 200) + 0.01
        data.add({"kind": "train", "step": s, "wall_time": s * 0.1, "loss": loss, "device_loss": {"cpu:0": loss}})
    for height in (500, 700, 800):
        panel.resize(1024, height)
        show(panel, data, qtbot)
        panel.set_log_y(True)
        panel.refresh()
        qtbot.wait(20)
        axis = panel.loss.getAxis("left")
        image = QImage(10, 10, QImage.Format.Format_ARGB32)
        painter = QPainter(image)
        texts = [(r, t) for r, _f, t in axis.generateDrawSpecs(painter)[2] if t]
        painter.end()
        assert len(texts) >= 2
        rects = sorted(r.top() for r, _ in texts)
        heights = texts[0][0].height()
        assert all(b - a >= heights for a, b in itertools.pairwise(rects)), [t for _, t in texts]


def test_an_empty_panel_keeps_nothing_of_the_previous_run(panel, qtbot):
    show(panel, make_run(n=500), qtbot)
    assert panel.loss.vb.viewRange()[0][1] > 4000
    panel.reset()
    qtbot.wait(20)
    for p in panel.plots:
        assert p.vb.viewRange()[0][1] <= 1.5, p.titleLabel.text
    assert panel.loss.vb.viewRange()[1][1] <= 1.5
    assert not any(item.isVisible() and len(item.getData()[0] or []) for item in panel.loss.listDataItems())


def test_plots_neither_pan_nor_hover_before_step_zero(panel, qtbot):
    show(panel, make_run(n=100), qtbot)
    vb = panel.loss.vb
    vb.translateBy(x=-5000)
    panel.refresh()
    assert vb.viewRange()[0][0] >= 0 and panel.throughput.vb.viewRange()[0][0] >= 0
    panel.set_x_mode("time")
    panel.set_auto_range(True)
    panel.fit_x()
    assert panel.loss.vb.viewRange()[0][0] >= 0
    # the mouse left of step 0: no crosshair, no "step -12"
    scene_pos = vb.mapViewToScene(QPointF(-12.0, 1.0))
    panel._on_mouse((scene_pos,))
    assert "-" not in panel.header.text.split("·")[0]
    assert not any(line.isVisible() for line in panel._lines)


def test_equal_ranks_memory_lines_both_show(panel, qtbot):
    data = RunData("ddp")
    for k in range(1, 200):
        data.add(
            {"kind": "train", "step": k, "wall_time": k * 0.5, "loss": 1.0, "device_loss": {"cpu:0": 1, "cpu:1": 1}}
        )
        for rank in ("cpu:0", "cpu:1"):  # a ddp run on the CPU: each rank's own process
            data.add({"kind": "telemetry", "step": k, "wall_time": k * 0.5, "devices": {rank: {"rss_mb": 400.0 + k}}})
    show(panel, data, qtbot)
    image = panel.grab().toImage()
    rect = panel.memory.vb.sceneBoundingRect().toRect()
    a = panel._device_color("cpu:0")
    b = panel._device_color("cpu:1")
    counts = count_colours(image, rect, [a, b])
    assert counts[0] > 100 and counts[1] > 100, counts


def test_clicking_a_key_entry_hides_and_shows_its_curves(panel, qtbot):
    from PySide6.QtTest import QTest

    show(panel, make_run(n=100, evals=(500, 1000)), qtbot)
    for group, keys in (("dev:cpu:1", ["loss/cpu:1", "util/cpu:1"]), ("combined", ["loss"]), ("validation", ["val"])):
        assert all(panel._curves[k].isVisible() for k in keys)
        QTest.mouseClick(panel.viewport(), Qt.MouseButton.LeftButton, pos=key_entry_point(panel, group))
        assert not any(panel._curves[k].isVisible() for k in keys), group
        assert panel._curves["loss/cpu:0"].isVisible()  # only that entry's curves
        QTest.mouseClick(panel.viewport(), Qt.MouseButton.LeftButton, pos=key_entry_point(panel, group))
        assert all(panel._curves[k].isVisible() for k in keys), group


def key_entry_point(panel, href):
    """Where the key shows the entry linking to ``href``, in the view's pixels."""
    item = panel.key.item
    layout = item.document().documentLayout()
    rect = item.boundingRect()
    for y in np.linspace(rect.top() + 2, rect.bottom() - 2, 6):
        for x in np.linspace(rect.left(), rect.right(), 400):
            if layout.anchorAt(QPointF(x, y)) == href:
                return panel.mapFromScene(item.mapToScene(QPointF(x + 3, y)))
    raise AssertionError(f"no key entry {href}: {panel.key.text}")


def test_the_metric_panel_is_titled_by_its_metric(panel, qtbot):
    data = make_run(n=50, evals=(100, 200))
    show(panel, data, qtbot)
    assert panel.metric_plot.titleLabel.text == "accuracy"
    data = RunData("charlm")
    data.add({"kind": "train", "step": 1, "wall_time": 1.0, "loss": 3.0})
    data.add({"kind": "eval", "step": 1, "wall_time": 1.0, "val_loss": 3.1, "metrics": {"bits_per_byte": 4.2}})
    show(panel, data, qtbot)
    assert panel.metric_plot.titleLabel.text == "bits per byte"


def test_comparing_runs_draws_every_panel_per_run_and_names_what_differs(panel, qtbot):
    a = make_run(n=100, evals=(500, 1000), name="a")
    b = make_run(n=80, seed=1, evals=(400, 800), name="b")
    b.train.columns["lr"].data[:] = 0.05  # a larger learning rate than the shown run's
    a.config = {"optim": {"lr": 0.01, "name": "adam"}, "data": {"batch_size": 64}, "run": {"name": "a"}}
    b.config = {"optim": {"lr": 0.05, "name": "adam"}, "data": {"batch_size": 64}, "run": {"name": "b"}}
    show(panel, a, qtbot)
    panel.add_overlay(b)
    panel.refresh()
    for k, run in enumerate((a, b)):
        for what in ("loss", "val", "samples_per_s", "lr", "step", "metric/accuracy"):
            item = panel._curves[f"cmp{k}:{what}"]
            assert item.isVisible() and item.opts["pen"].color().name().upper() == series_color(k).upper(), what
            assert np.isfinite(drawn(item)[1]).sum() >= 2, what
        for j, dev in enumerate(("cpu:0", "cpu:1")):  # utilization: each device in its own colour, every run
            item = panel._curves[f"cmp{k}:util/{dev}"]
            assert item.isVisible() and item.opts["pen"].color().name().upper() == series_color(j).upper(), dev
        assert np.isfinite(drawn(panel._curves[f"cmp{k}:rss_mb"])[1]).sum() >= 2
        np.testing.assert_allclose(drawn(panel._curves[f"cmp{k}:samples_per_s"])[1], run.train.get("samples_per_s"))
    assert not panel._curves["samples_per_s"].isVisible() and not panel._stack[0].isVisible()
    # every run's values inside the axes that start at zero (a larger lr of the compared run too)
    assert panel.lr.vb.viewRange()[1][1] >= max(np.nanmax(r.train.get("lr")) for r in (a, b))
    assert "a (lr 0.01)" in panel.key.text and "b (lr 0.05)" in panel.key.text and "batch_size" not in panel.key.text


def test_a_panel_with_no_data_is_hidden_and_the_key_says_why(panel, qtbot):
    # no grad_norm in the records, and evaluations with no metric: both panels go, the key names them
    run = make_run(n=30, evals=())
    run.add({"kind": "eval", "step": 300, "wall_time": 2000.0, "val_loss": 0.5, "metrics": {}})
    show(panel, run, qtbot)
    assert not panel.grad_norm.isVisible() and not panel.metric_plot.isVisible()
    key = panel.key.text
    assert "not shown, no data: gradient norm: not logged by this run; validation metric: the task reports none" in key
    # a run that logs them shows both, with their data, and the key no longer mentions them
    with_norm = RunData("with-norm")
    with_norm.add({"kind": "event", "event": "started", "step": 0, "wall_time": 1000.0})
    for s in range(10, 310, 10):
        with_norm.add({"kind": "train", "step": s, "wall_time": 1000.0 + s, "loss": 1.0, "grad_norm": 2.0 + s / 100})
    with_norm.add({"kind": "eval", "step": 300, "wall_time": 1400.0, "val_loss": 0.5, "metrics": {"accuracy": 0.8}})
    show(panel, with_norm, qtbot)
    assert panel.grad_norm.isVisible() and panel.metric_plot.isVisible()
    assert "not shown" not in panel.key.text
    (item,) = [i for i in panel.grad_norm.listDataItems() if i.isVisible()]
    np.testing.assert_allclose(drawn(item)[1], [2.0 + s / 100 for s in range(10, 310, 10)])
    # a run that ended without evaluating: its metric panel goes too, saying so; while it runs it stays
    live = make_run(n=5)
    show(panel, live, qtbot)
    assert panel.metric_plot.isVisible()
    live.add({"kind": "event", "event": "finished", "step": 50, "wall_time": 2000.0})
    show(panel, live, qtbot)
    assert not panel.metric_plot.isVisible() and "validation metric: no evaluation in this run" in panel.key.text
