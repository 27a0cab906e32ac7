"""Exported figures that never lie: the matplotlib artists and the rendered PNGs of `loss.*` and
`plots.*`, compared with the samples a run logged (no Qt needed)."""

import numpy as np
import pytest
from helpers import run_with_a_lone_step
from multilane.gui.plots.export import export_run
from multilane.gui.plots.figures import FigureOptions, loss_figure
from multilane.gui.plots.overview import comparison_overview_figure, overview_figure
from multilane.gui.plots.palette import series_color
from test_plots_truth import make_run


def colour_pixels(png, colour, tol=60):
    import matplotlib.image as mpimg

    img = (mpimg.imread(png)[..., :3] * 255).astype(int)
    want = np.array([int(colour[i : i + 2], 16) for i in (1, 3, 5)])
    return int((np.abs(img - want).sum(axis=2) < tol).sum())


def lines_of(ax):
    return [line for line in ax.get_lines() if len(line.get_xdata())]


def test_exported_loss_and_plots_show_every_equal_devices_colour(tmp_path):
    run = make_run(n=300, devices=("cpu:0", "cpu:1", "cpu:2"))
    export_run(run, tmp_path, ["png"], 1600)
    for name in ("loss.png", "plots.png"):
        counts = [colour_pixels(tmp_path / name, series_color(i)) for i in range(3)]
        assert all(c > 400 for c in counts), (name, counts)


def test_a_pause_and_a_stop_break_every_exported_line_and_are_marked(tmp_path):
    run = make_run(n=300, pause_at=1500, evals=(500, 1000, 2000, 2500))
    pause = next(e for e in run.events if e["event"] == "paused")["wall_time"] - run.t0
    resume = next(e for e in run.events if e["event"] == "resumed")["wall_time"] - run.t0
    opts = FigureOptions(x_mode="time")
    for fig in (loss_figure(run, opts), overview_figure(run, opts)):
        for ax in fig.axes:
            for line in lines_of(ax):
                x, y = np.asarray(line.get_xdata(), float), np.asarray(line.get_ydata(), float)
                if len(x) < 2 or line.get_linestyle() == "None":
                    continue
                across = (x[:-1] <= pause) & (x[1:] >= resume) & np.isfinite(y[:-1]) & np.isfinite(y[1:])
                assert not across.any(), (ax.get_title(loc="left"), line.get_label())
            bands = [p for p in ax.patches if p.get_x() == pytest.approx(pause, abs=0.05)]
            assert bands, ax.get_title(loc="left")  # the pause shaded in every panel
    fig = loss_figure(run, FigureOptions(x_mode="step"))
    marks = [line for line in fig.axes[0].get_lines() if line.get_label() == "paused"]
    assert len(marks) == 1 and marks[0].get_xdata()[0] == 1490


def test_the_exported_plots_hold_the_step_time_and_leave_no_empty_cell(tmp_path):
    run = make_run(n=100, evals=(500, 1000))
    fig = overview_figure(run)
    titles = [ax.get_title(loc="left") for ax in fig.axes if ax.get_visible()]
    assert "Step time" in titles and "accuracy" in titles and "Validation metric" not in titles
    assert all(ax.get_visible() and (ax.lines or ax.collections) for ax in fig.axes)  # no empty cell
    step = next(ax for ax in fig.axes if ax.get_title(loc="left") == "Step time")
    tops = [c.get_paths()[0].vertices[:, 1].max() for c in step.collections]
    assert max(tops) == pytest.approx(8.0)  # forward 3 + backward 5, stacked
    # an even number of panels: still a full grid
    run.telemetry = type(run.telemetry)()
    fig = overview_figure(run)
    assert all(ax.lines or ax.collections for ax in fig.axes)


def test_a_single_logged_point_is_exported_with_a_marker():
    from multilane.gui.runs.run_data import RunData

    run = RunData("one")
    run.add({"kind": "train", "step": 5, "wall_time": 1.0, "loss": 3.0, "samples_per_s": 10.0})
    run.add({"kind": "eval", "step": 5, "wall_time": 1.0, "val_loss": 3.1, "metrics": {"bits_per_byte": 4.2}})
    for fig in (loss_figure(run), overview_figure(run)):
        for ax in fig.axes:
            for line in lines_of(ax):
                if np.isfinite(np.asarray(line.get_ydata(), float)).sum() == 1:
                    assert line.get_marker() not in (None, "None", ""), (ax.get_title(loc="left"), line.get_label())
    assert "bits per byte" in [ax.get_title(loc="left") for ax in overview_figure(run).axes]


def test_a_step_logged_alone_between_two_stops_is_exported_with_a_marker_there_only():
    run = run_with_a_lone_step(40, 21, 100)
    ax = loss_figure(run).axes[0]
    marked = []
    for line in lines_of(ax):
        x, y = np.asarray(line.get_xdata(), float), np.asarray(line.get_ydata(), float)
        every = line.get_markevery()
        if line.get_marker() not in (None, "None", "") and every is not None:
            marked += [(line.get_label(), x[i]) for i in np.flatnonzero(every) if np.isfinite(y[i])]
    assert sorted(x for _, x in marked) == [21.0] * len(marked) and len(marked) >= 1, marked


def test_a_comparisons_plots_draw_every_panel_per_run_and_name_what_differs(tmp_path):
    a, b = make_run(n=100, evals=(500, 1000), name="a"), make_run(n=80, seed=1, evals=(400,), name="b")
    a.config = {"optim": {"lr": 0.01}, "data": {"batch_size": 64}}
    b.config = {"optim": {"lr": 0.05}, "data": {"batch_size": 64}}
    fig = comparison_overview_figure([a, b])
    titles = {ax.get_title(loc="left"): ax for ax in fig.axes}
    for title in ("Loss", "accuracy", "Throughput", "Learning rate", "Step time (each run's total)"):
        colours = {line.get_color().upper() for line in lines_of(titles[title])}
        assert {series_color(0).upper(), series_color(1).upper()} <= colours, title
    # utilization: each device in its colour, in every run (test_gui_compare.py checks each line)
    util = lines_of(titles["Utilization (colour: device, line: run)"])
    assert [ln.get_color().upper() for ln in util] == [series_color(j).upper() for j in (0, 1)] * 2
    assert len(lines_of(titles["Process memory: RSS (line: run)"])) == 2  # CPU lanes: one process's RSS a run
    thr = [ln for ln in lines_of(titles["Throughput"]) if ln.get_color().upper() == series_color(1).upper()]
    np.testing.assert_allclose(thr[0].get_ydata(), b.train.get("samples_per_s"))
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "a (lr 0.01)" in legend and "b (lr 0.05)" in legend
    written = export_run(a, tmp_path, ["png"], 1200, compare=[b])
    assert {p.name for p in written} == {"loss.png", "compare.png", "plots.png"}
    assert colour_pixels(tmp_path / "plots.png", series_color(1)) > 1000
