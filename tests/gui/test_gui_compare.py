"""Compare hides nothing: a run whose values equal another's stays visible in every panel, in
the app (what is painted) and in the exported plots.png; the step-time panel names the runs, not the
phases; the hover names every run with its value. Utilization and memory draw each device of each run,
in the device's colour, each run in its own line style: every drawn item checked against the records."""

import numpy as np
import pytest

pytest.importorskip("PySide6")

from matplotlib.backends.backend_agg import FigureCanvasAgg
from multilane.gui.plots.figures import comparison_figure
from multilane.gui.plots.overview import comparison_overview_figure
from multilane.gui.plots.palette import GAP, NEUTRAL, run_dash, series_color
from multilane.gui.runs.run_data import RunData
from PySide6.QtCore import Qt
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
    for what, plot in (("loss", panel.loss), ("step", panel.phases)):
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
        assert "loss " in part and "process RSS 300.0 MiB" in part, part
        assert "cpu:0 utilization 50%" in part and "cpu:1 utilization 50%" in part, part  # each device, named
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
    for title in ("Loss", "Step time (each run's total)"):
        x0, y0, x1, y1 = titles[title].get_window_extent().extents.astype(int)
        box = rgb[h - y1 : h - y0, x0:x1]
        assert colour_pixels(box, series_color(0)) > 30, title
        assert colour_pixels(box, series_color(1)) > 30, title


DEVICES = ("cpu:1", "cpu:0")  # the run's own order: cpu:1 has the first colour


def busy_of(j: int, step: int) -> float:
    return 30.0 + 25.0 * j + 5.0 * ((step // 10) % 4)  # each device its own values, varying


def equal_runs(memory: str = "rss"):
    """Two runs whose every value is equal and whose devices differ from each other: CPU lanes (one
    process's RSS) or GPUs (each device's memory used)."""
    runs = []
    for name in ("run-a", "run-b"):
        run = RunData(name)
        run.add({"kind": "event", "event": "started", "step": 0, "wall_time": 1000.0, "lanes": list(DEVICES)})
        for s in range(10, 610, 10):
            run.add({"kind": "train", "step": s, "wall_time": 1000.0 + s / 100, "loss": 1.0 / s})
            devs = {d: {"busy_pct": {"mean": busy_of(j, s)}} for j, d in enumerate(DEVICES)}
            if memory == "gpu":
                for j, d in enumerate(DEVICES):
                    devs[d]["mem_used_mb"] = 1000.0 + 100 * j + s
            rec = {"kind": "telemetry", "step": s, "wall_time": 1000.0 + s / 100, "devices": devs}
            run.add(rec | ({"process": {"rss_mb": 300.0 + s / 10}} if memory == "rss" else {}))
        runs.append(run)
    return runs


def pen_of(item) -> tuple[str, float, list[float] | None]:
    pen = item.opts["pen"]
    dash = list(pen.dashPattern()) if pen.style() == Qt.PenStyle.CustomDashLine else None
    return pen.color().name().upper(), pen.widthF(), dash


@pytest.mark.parametrize("memory", ["rss", "gpu"])
def test_compared_utilization_and_memory_draw_each_device_of_each_run_as_recorded(panel, qtbot, memory):
    a, b = equal_runs(memory)
    show(panel, a, qtbot)
    panel.add_overlay(b)
    panel.refresh()
    mem_cols = [f"mem/{d}" for d in DEVICES] if memory == "gpu" else ["rss_mb"]
    expected = {}
    for plot, cols in ((panel.util, [f"util/{d}" for d in DEVICES]), (panel.memory, mem_cols)):
        lines = [(k, run, col) for k, run in enumerate((a, b)) for col in cols]
        widths = []
        for i, (k, run, col) in enumerate(lines):
            item = panel._curves[f"cmp{k}:{col}"]
            dev = col.split("/", 1)[1] if "/" in col else None
            colour, width, dash = pen_of(item)
            # the device's colour (its place in the run's device list), the run's line style
            assert colour == (series_color(DEVICES.index(dev)) if dev else NEUTRAL).upper(), (k, col)
            assert dash == (None if run_dash(k) is None else list(run_dash(k))), (k, col)
            x, y = item.getData()  # what is drawn: every record of that column, no other point
            np.testing.assert_array_equal(x, run.telemetry.get("step"))
            np.testing.assert_array_equal(y, run.telemetry.get(col))
            assert item.isVisible() and item.zValue() == 2 * i + 1
            widths.append(width)
            expected[id(item)] = (k, col)
            if run_dash(k) is not None:  # white under the dashes, the same line
                gap = panel._curves[f"cmp{k}:{col}|gap"]
                assert pen_of(gap) == (GAP.upper(), width, None) and gap.zValue() == 2 * i
                np.testing.assert_array_equal(gap.getData()[1], y)
                expected[id(gap)] = (k, col)
        assert widths == sorted(widths, reverse=True) and len(set(widths)) == len(widths)  # each next narrower
        # a device's line 2 px under the same device's of the run before: its colour at both edges on screen
        assert all(a - b >= 2.0 for a, b in zip(widths, widths[len(cols) :], strict=False))
        # nothing else drawn there: not the shown run's own lines, nor a mean over devices
        visible = {id(it) for it in plot.listDataItems() if it.isVisible()}
        assert visible == set(expected) - {i for i in expected if i not in map(id, plot.listDataItems())}
    text = panel.show_values_at(300)
    for name in ("run-a", "run-b"):
        part = next(p for p in text.split(" · ") if p.startswith(f"{name}: "))
        for j, d in enumerate(DEVICES):
            assert f"{d} utilization {busy_of(j, 300):.0f}%" in part, part
        assert ("process RSS 330.0 MiB" if memory == "rss" else "cpu:0 memory used 1,400 MiB") in part, part
    assert panel.util.titleLabel.text == "Utilization (%)"  # one line at 1280 px: the colours are in the key
    key = panel.key.text
    assert f'color:{series_color(0)}; font-weight:bold;">━━</span>&nbsp;cpu:1' in key and "(line: the run's" in key
    assert key.index("run-a") < key.index("━━</span>", key.index("run-a")) < key.index("run-b") < key.index("╍╍")
    panel.toggle_curve("run:1")  # a run hidden from the key: its lines (and their white) go too
    assert not panel._curves["cmp1:util/cpu:0"].isVisible() and not panel._curves["cmp1:util/cpu:0|gap"].isVisible()
    assert panel._curves["cmp0:util/cpu:0"].isVisible()


def test_equal_runs_both_show_in_each_devices_painted_line(panel, qtbot):
    """Run b's line equal to run a's, the same device's colour: its dashes show inside run a's line
    (white gaps between them) and run a's colour at their edges — counted in the painted pixels, for
    each lane's utilization and for the one process's memory of CPU lanes (one line a run)."""
    a, b = equal_runs()
    for run in (a, b):  # one level for the whole run: a flat line, easy to read across
        for j, d in enumerate(DEVICES):
            run.telemetry.columns[f"util/{d}"].data[:] = 20.0 + 50.0 * j
        run.telemetry.columns["rss_mb"].data[:] = 300.0
    show(panel, a, qtbot)
    panel.add_overlay(b)
    panel.refresh()
    qtbot.wait(50)
    lines = [(panel.util, series_color(j), dev) for j, dev in enumerate(DEVICES)] + [(panel.memory, NEUTRAL, "RSS")]
    for plot, colour, dev in lines:
        rgb = painted(panel, plot)
        c = QColor(colour)
        mine = np.abs(rgb.astype(int) - [c.red(), c.green(), c.blue()]).max(axis=-1) <= 40
        white = rgb.min(axis=-1) >= 245
        gaps = edges = 0
        for col in range(rgb.shape[1]):
            rows = np.flatnonzero(mine[:, col])
            if len(rows) < 2 or rows[-1] - rows[0] > 12:
                continue  # not this line's band (a tick, or another line crossing)
            inside = white[rows[0] : rows[-1] + 1, col]
            gaps += bool(inside.any())  # run b's white gap between run a's edges
            edges += not inside.any()  # run b's dash: the colour across
        assert gaps >= 20 and edges >= 20, (dev, gaps, edges)


def test_the_exported_comparison_draws_each_device_of_each_run_as_recorded():
    a, b = equal_runs("gpu")
    fig = comparison_overview_figure([a, b])
    axes = {ax.get_title(loc="left"): ax for ax in fig.axes}
    for title, prefix in (("Utilization (colour: device, line: run)", "util/"), ("Memory used (line: run)", "mem/")):
        lines = [ln for ln in axes[title].get_lines() if len(ln.get_xdata())]
        assert len(lines) == 4, title  # two devices, two runs
        for i, ((k, run), d) in enumerate((kr, d) for kr in enumerate((a, b)) for d in DEVICES):
            line = lines[i]
            assert line.get_color().upper() == series_color(DEVICES.index(d)).upper(), (title, k, d)
            dash = run_dash(k)
            if dash is None:
                assert line.get_linestyle() == "-"
            else:
                assert tuple(line._unscaled_dash_pattern[1]) == dash and line.get_gapcolor().upper() == GAP
            np.testing.assert_array_equal(line.get_xdata(), run.telemetry.get("step"))
            np.testing.assert_array_equal(line.get_ydata(), run.telemetry.get(f"{prefix}{d}"))
        widths = [ln.get_linewidth() for ln in lines]
        assert widths == sorted(widths, reverse=True) and len(set(widths)) == 4, title
        names = [t.get_text() for t in axes[title].get_legend().get_texts()]
        assert names == [*DEVICES, "run-a", "run-b"], names


def test_the_exported_loss_comparison_shows_equal_runs_both():
    """compare.*: two equal runs' train and validation losses, the first widest, the second over it."""
    a, b = twins()
    fig = comparison_figure([a, b])
    lines = [ln for ln in fig.axes[0].get_lines() if len(ln.get_xdata())]
    by_colour = {c: [ln for ln in lines if ln.get_color().upper() == c] for c in (series_color(0), series_color(1))}
    for (train_a, val_a), (train_b, val_b) in [tuple(by_colour.values())]:
        np.testing.assert_array_equal(train_a.get_ydata(), train_b.get_ydata())  # equal: one over the other
        for first, second in ((train_a, train_b), (val_a, val_b)):
            assert second.get_linewidth() < first.get_linewidth() and second.get_zorder() > first.get_zorder()
    FigureCanvasAgg(fig).draw()
    rgb = np.asarray(fig.canvas.buffer_rgba())[..., :3]
    h = rgb.shape[0]
    x0, y0, x1, y1 = fig.axes[0].get_window_extent().extents.astype(int)
    box = rgb[h - y1 : h - y0, x0:x1]
    assert colour_pixels(box, series_color(0)) > 30 and colour_pixels(box, series_color(1)) > 30


def ranked_run(name: str, strategy: str):
    """digits-like records of one run on cpu:0 and cpu:1: CPU lanes (one process) or ddp ranks (a process
    each, its devices named ``vm/rankN/cpu:N``)."""
    devices = ["cpu:0", "cpu:1"] if strategy == "replicate" else ["vm/rank0/cpu:0", "vm/rank1/cpu:1"]
    run = RunData(name)
    run.add({"kind": "event", "event": "started", "step": 0, "wall_time": 1000.0, "lanes": devices})
    for s in range(10, 310, 10):
        run.add({"kind": "train", "step": s, "wall_time": 1000.0 + s / 100, "loss": 1.0 / s})
        rec = {"kind": "telemetry", "step": s, "wall_time": 1000.0 + s / 100}
        entries = {d: {"busy_pct": {"mean": busy_of(j, s)}} for j, d in enumerate(devices)}
        if strategy == "replicate":  # one process, one record
            run.add(rec | {"devices": entries, "process": {"rss_mb": 300.0 + s / 10}})
            continue
        for j, (d, entry) in enumerate(entries.items()):  # a record a rank
            run.add(rec | {"devices": {d: entry | {"rss_mb": 280.0 + j * 20}}, "rank": j})
    return run


def test_one_device_has_one_colour_whatever_the_strategy_and_the_key_names_its_rank(panel, qtbot):
    plain, ranks = ranked_run("lanes", "replicate"), ranked_run("ranks", "ddp")
    show(panel, plain, qtbot)
    panel.add_overlay(ranks)
    panel.refresh()
    drawn = dict(panel._draw_compared_devices([plain, ranks]))
    # the ddp run's rank 0 ran on cpu:0: the same colour as the lanes' cpu:0, in utilization and memory
    for col, dev in (("util/cpu:0", "cpu:0"), ("util/cpu:1", "cpu:1")):
        colour = series_color(["cpu:0", "cpu:1"].index(dev)).upper()
        assert pen_of(drawn[f"cmp0:{col}"])[0] == colour, col
        rank = f"util/vm/rank{dev[-1]}/{dev}"
        assert pen_of(drawn[f"cmp1:{rank}"])[0] == colour, rank
        assert pen_of(drawn[f"cmp1:rss/vm/rank{dev[-1]}/{dev}"])[0] == colour
    key = panel.key.text
    assert "cpu:0 (rank 0)" in key and "cpu:1 (rank 1)" in key and "vm/rank0" not in key, key
    assert panel.util.titleLabel.text == "Utilization (%)"
    fig = comparison_overview_figure([plain, ranks])  # the export draws the same colours
    (util,) = [ax for ax in fig.axes if ax.get_title(loc="left").startswith("Utilization")]
    colours = {ln.get_color().upper() for ln in util.get_lines() if len(ln.get_xdata())}
    assert colours == {series_color(0).upper(), series_color(1).upper()}, colours
