"""The last step before a stop drawn after a resume; a followed run's settings in
the greyed form; metrics.csv with the telemetry plots.png shows; the summary box after opening a
TensorBoard logdir; a long task-file path that does not widen the runs table."""

import csv
import json

import numpy as np
import pytest
from helpers import run_with_a_lone_step

pytest.importorskip("PySide6")

from multilane.engine.run.trainer import Trainer
from multilane.gui.runs.run_data import RunData
from test_plots_truth import show


@pytest.fixture
def panel(qtbot):
    from multilane.gui.plots.panel import PlotPanel

    p = PlotPanel()
    qtbot.addWidget(p)
    p.resize(1000, 700)
    p.show()
    qtbot.waitExposed(p)
    return p


def stopped_and_resumed(n: int, stop_at: int) -> RunData:
    """A noisy run of ``n`` logged steps, stopped after step ``stop_at`` and resumed from it 60 s later."""
    rng = np.random.default_rng(3)
    d = RunData("resumed")
    d.add({"kind": "event", "event": "started", "step": 0, "wall_time": 1000.0, "lanes": ["cpu:0"]})
    t = 1000.0
    for s in range(1, n + 1):
        t += 0.05
        if s == stop_at + 1:
            d.add({"kind": "event", "event": "stopped", "step": stop_at, "wall_time": t})
            t += 60.0
            d.add({"kind": "event", "event": "started", "step": stop_at, "wall_time": t, "resumed_from_step": stop_at})
            t += 0.05
        loss = 1.0 + rng.random()  # noise: the step before the stop is no pixel column's extreme
        d.add({"kind": "train", "step": s, "wall_time": t, "loss": loss, "device_loss": {"cpu:0": loss}})
    return d


@pytest.mark.parametrize("x_mode", ["step", "time"])
def test_the_last_step_before_a_stop_and_the_first_after_the_resume_are_drawn(panel, qtbot, x_mode):
    run = stopped_and_resumed(40_000, 23_457)
    show(panel, run, qtbot)
    panel.set_x_mode(x_mode)
    panel.refresh()
    x_of = {s: x for s, x in zip(run.train.get("step"), panel._x(run, run.train), strict=True)}
    for key in ("loss", "loss/cpu:0"):
        x, y = panel._curves[key].getData()
        assert len(x) < run.train.rows / 4  # decimated: not every point is drawn
        drawn = set(np.asarray(x)[np.isfinite(y)].tolist())
        assert x_of[23_457] in drawn and x_of[23_458] in drawn, key
        i = int(np.flatnonzero(np.asarray(x) == x_of[23_457])[0])
        assert np.isnan(y[i + 1]), key  # and the line breaks right after it: no trend across the stop


def test_a_step_logged_alone_between_two_stops_is_drawn_as_a_marker(panel, qtbot):
    """Stopped after step 100, resumed, stopped again after step 101, resumed: step 101 has no neighbour
    on either side of its breaks, so a line draws nothing there; a marker draws it (and no other point)."""
    run = run_with_a_lone_step(200, 101, 1000)
    show(panel, run, qtbot)
    for x_mode in ("step", "time"):
        panel.set_x_mode(x_mode)
        panel.refresh()
        x101 = panel._x(run, run.train)[100]
        for key in ("loss", "loss/cpu:0"):
            item = panel._curves[key]
            marked = [p.pos().x() for p in item.scatter.points() if p.size() > 0 and np.isfinite(p.pos().y())]
            assert marked == [x101], (key, x_mode, marked)
    qtbot.wait(50)  # painted without an error


def short_run(make_config, **overrides):
    cfg = make_config(task__name="linear", train__steps=8, train__log_every=2, **overrides)
    return Trainer(cfg).run().run_dir


@pytest.mark.slow
def test_metrics_csv_has_the_telemetry_plots_png_shows_for_a_short_run(make_config, tmp_path):
    """A run shorter than one telemetry interval: its one record (written at the end) covers every step."""
    from multilane.engine.cli.main import main

    run = short_run(make_config, telemetry__record_s=60.0, devices__use="cpu:0,cpu:1")
    out = tmp_path / "out"
    assert main(["export", str(run), "--out", str(out), "--format", "csv"]) == 0
    rows = list(csv.DictReader((out / "metrics.csv").open()))
    assert len(rows) == 4
    for col in ("util/cpu:0", "util/cpu:1", "rss_mb"):
        assert all(r[col] != "" and float(r[col]) >= 0 for r in rows), col
    data = RunData.from_run_dir(run)  # what plots.png draws: the same record
    assert np.isfinite(data.telemetry.get("util/cpu:0")).sum() >= 1


def test_following_a_run_shows_its_settings_in_the_greyed_form_then_the_windows_own(qtbot, make_window, make_config):
    run = short_run(make_config, optim__lr=0.0123, devices__use="cpu:1,cpu:0")
    window = make_window()
    window.form.editors["optim.lr"].widget.setText("0.5")
    window.form.editors["train.steps"].widget.setValue(777)
    assert window.follow_run(str(run))
    values = window.form.values()
    assert values["optim"]["lr"] == pytest.approx(0.0123) and values["train"]["steps"] == 8
    assert not window.form.isEnabled() and not window.devices.isEnabled()
    assert window.plots.data.devices[:2] == ["cpu:1", "cpu:0"]  # colours from the followed run's list
    qtbot.waitUntil(lambda: not window.is_running(), timeout=60_000)
    values = window.form.values()
    assert values["optim"]["lr"] == pytest.approx(0.5) and values["train"]["steps"] == 777
    assert window.form.isEnabled()


@pytest.mark.slow
def test_opening_a_tensorboard_logdir_shows_its_summary_not_the_previous_runs(
    qtbot, make_window, make_config, tmp_path
):
    from torch.utils.tensorboard import SummaryWriter

    window = make_window()
    run = short_run(make_config)
    window.open_run(str(run))
    assert not window.summary.isHidden() and run.name in window.summary.text()
    logdir = tmp_path / "tb" / "tbrun"
    w = SummaryWriter(str(logdir))
    for step in range(1, 6):
        w.add_scalar("train_loss", 1.0 / step, step)
    w.close()
    assert window.open_tensorboard(str(logdir))
    text = window.summary.text()
    assert not window.summary.isHidden() and "tbrun" in text and run.name not in text, text
    last = window.plots.data.train.get("loss")[-1]
    assert f"{last:.2f}" in text and "1.0000" not in text  # its own losses (1/step), not the linear run's


def test_a_long_task_file_path_does_not_widen_the_runs_table(qtbot, make_window, tmp_path):
    from multilane.gui.table.runs_table import TASK_COLUMN_PX

    runs = tmp_path / "runs"
    long_task = "/home/someone/" + "very_long_folder_name/" * 12 + "my_task.py"
    for name, task in (("short", "mlp"), ("long", long_task)):
        folder = runs / name
        folder.mkdir(parents=True)
        config = {"task": {"name": task}, "devices": {"use": "cpu:0"}, "optim": {"name": "adam", "lr": 0.01}}
        (folder / "config.json").write_text(json.dumps(config))
        (folder / "metrics.jsonl").write_text(
            json.dumps({"kind": "train", "step": 1, "wall_time": 1.0, "loss": 0.5}) + "\n"
        )
    window = make_window()
    table = window.runs_table
    table.load(str(runs))
    col = table._task_col
    assert table.table.columnWidth(col) <= TASK_COLUMN_PX
    r = next(i for i in range(table.table.rowCount()) if table.table.item(i, col).text() == long_task)
    assert table.table.item(r, col).toolTip().startswith(long_task)  # the whole path, on hover
