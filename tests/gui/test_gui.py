"""The desktop app, driven as a user would: the real window, offscreen, with pytest-qt."""

import json
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("PySide6")

from helpers import BROKEN_TASK, NO_PARAMS_TASK
from multilane.engine.rundir.runlog import read_metrics
from multilane.gui.runs.worker import TrainWorker
from multilane.gui.window.main_window import MainWindow
from PySide6.QtCore import QSettings, Qt
from PySide6.QtGui import QImage


def configure(w, task="linear", steps=20, log_every=2, eval_every=10):
    w.form.set_task(task)
    w.form.editors["train.steps"].widget.setValue(steps)
    w.form.editors["train.log_every"].widget.setValue(log_every)
    w.form.editors["train.eval_every"].widget.setValue(eval_every)
    assert w.validate() == []


def wait_finished(qtbot, w, timeout=120_000):
    # Not waitSignal(worker.finished): that signal fires in the worker's thread, and pytest-qt would
    # stop its timeout timer from there. The window's own state flips in the GUI thread.
    qtbot.waitUntil(lambda: not w.is_running(), timeout=timeout)
    return w.last_result


def start_and_wait(qtbot, w, timeout=120_000):
    assert w.start_btn.isEnabled(), w.why.text()
    qtbot.mouseClick(w.start_btn, Qt.LeftButton)
    return wait_finished(qtbot, w, timeout)


def test_two_lanes_run_plots_every_logged_point_of_every_device(qtbot, window):
    configure(window, steps=20, log_every=2)
    result = start_and_wait(qtbot, window)
    assert result["status"] == "finished", result
    window.plots.refresh()
    steps = [r["step"] for r in read_metrics(result["run_dir"]) if r["kind"] == "train"]
    assert steps == list(range(2, 21, 2))
    for dev in ("cpu:0", "cpu:1"):
        curve = window.plots._curves[f"loss/{dev}"]
        assert list(curve.xData) == steps
    assert len(window.plots._curves["loss"].yData) == 10
    assert list(window.plots._curves["val"].xData) == [10, 20]
    assert "Finished at step 20" in window.status_label.text()
    assert window.start_btn.isEnabled() and not window.stop_btn.isEnabled()


@pytest.mark.slow
def test_export_png_svg_pdf_csv_from_the_app(qtbot, window, tmp_path):
    configure(window, steps=12, log_every=1)
    result = start_and_wait(qtbot, window)
    files = window.export(str(tmp_path / "out"), ["png", "svg", "pdf", "csv"], width=900, bundle=True)
    names = {f.name for f in files}
    assert {"loss.png", "plots.png", "loss.svg", "loss.pdf", "plots.svg", "metrics.csv"} <= names
    assert {"config.json", "environment.json"} <= names
    svg_text = " ".join(
        t.text or "" for t in ET.parse(tmp_path / "out" / "loss.svg").getroot().iter() if t.tag.endswith("text")
    )
    assert Path(result["run_dir"]).name in svg_text and "step" in svg_text and "loss" in svg_text
    img = QImage(str(tmp_path / "out" / "loss.png"))
    assert img.width() == 900
    colors = {img.pixel(x, y) for x in range(0, img.width(), 7) for y in range(0, img.height(), 7)}
    assert len(colors) > 5  # not blank
    root = ET.parse(tmp_path / "out" / "loss.svg").getroot()
    assert root.tag.endswith("svg") and len(list(root.iter())) > 20
    rows = (tmp_path / "out" / "metrics.csv").read_text().splitlines()
    assert rows[0].startswith("step,wall_time,elapsed_s,loss,loss/cpu:0,loss/cpu:1")
    assert [int(r.split(",")[0]) for r in rows[1:]] == list(range(1, 13))


@pytest.mark.slow
def test_the_plots_right_click_export_is_the_apps_own(qtbot, window, tmp_path):
    # pyqtgraph's own "Export..." (its SVG exporter breaks with PySide6 6.12) is replaced by the app's,
    # which asks once: folder (starting in the run's folder), PNG width and formats in one dialog.
    configure(window, steps=8, log_every=1)
    result = start_and_wait(qtbot, window)
    # the menu pyqtgraph assembles on a right click in a plot (its own items, then the scene's)
    from types import SimpleNamespace

    from PySide6.QtWidgets import QMenu

    menu = window.plots.scene().addParentContextMenus(window.plots.loss.vb, QMenu(), SimpleNamespace(acceptedItem=None))
    texts = [a.text() for a in menu.actions()]
    assert "Export figures and CSV…" in texts and "Export bundle…" in texts
    assert "Export..." not in texts
    window.plots.export_actions[0].trigger()
    dialog = window.export_box
    assert dialog.isVisible() and dialog.folder.text() == str(Path(result["run_dir"]) / "export")
    out = tmp_path / "from-menu"
    dialog.folder.setText(str(out))
    dialog.width.setValue(1000)
    dialog.formats["pdf"].setChecked(False)
    dialog.accept()
    # the export runs in a process of its own (gui/export/export_job.py): its files appear when it ends
    qtbot.waitUntil(lambda: "Exported" in window.note_label.text(), timeout=120_000)
    assert QImage(str(out / "loss.png")).width() == 1000
    assert ET.parse(out / "loss.svg").getroot().tag.endswith("svg")
    assert not (out / "loss.pdf").exists()
    assert len((out / "metrics.csv").read_text().splitlines()) == 1 + 8
    assert "Exported" in window.note_label.text()
    assert "Finished at step 8" in window.status_label.text()  # the final state stays in view


def test_export_to_an_unwritable_place_reports_and_keeps_the_run(qtbot, window, tmp_path):
    configure(window, steps=4, log_every=1)
    result = start_and_wait(qtbot, window)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    from multilane.engine.errors import UserError

    with pytest.raises(UserError, match="export: cannot"):
        window.export(str(blocker / "out"), ["png", "csv"])
    assert (
        json.loads((tmp_path / "runs").joinpath(result["run_dir"].split("/")[-1], "status.json").read_text())["state"]
        == "finished"
    )


def test_invalid_input_disables_start_and_says_why(qtbot, window):
    lr = window.form.editors["optim.lr"].widget
    lr.setText("-1")
    assert not window.start_btn.isEnabled()
    assert "optim.lr = -1.0: Input should be greater than 0" in window.why.text()
    assert "d62728" in lr.styleSheet()
    lr.setText("abc")
    assert "valid number" in window.why.text()
    lr.setText("0.01")
    assert window.start_btn.isEnabled() and lr.styleSheet() == ""
    window.devices.set_checked([])
    assert not window.start_btn.isEnabled() and "choose at least one device" in window.why.text()


def test_task_params_form_follows_the_task(window):
    window.form.set_task("mlp")
    assert {"width", "depth", "features"} <= set(window.form.param_editors)
    window.form.param_editors["width"].widget.setValue(0)  # below the schema's bound (ge=1) is clamped
    assert window.form.param_editors["width"].widget.value() >= 1
    window.form.set_task("digits")
    assert set(window.form.param_editors) == {"channels", "hidden"}
    assert window.form.param_editors["hidden"].widget.toolTip().startswith("Width of the hidden")


def test_the_parallel_strategy_is_chosen_in_the_form_with_its_explanation(window):
    combo = window.form.editors["devices.strategy"].widget
    assert [combo.itemText(i) for i in range(combo.count())] == ["replicate", "persistent", "ddp", "fsdp"]
    assert "persistent:" in combo.toolTip()
    combo.setCurrentText("persistent")
    window.devices.set_checked(["cpu:0", "cpu:1"])
    d = window.config_dict()
    assert d["devices"]["strategy"] == "persistent" and d["devices"]["use"] == "cpu:0,cpu:1"


def wait_for_train_steps(qtbot, w, n):
    qtbot.waitUntil(lambda: w.plots.data.train.rows >= n, timeout=60_000)


def test_pause_resume_and_stop_mid_run(qtbot, window):
    configure(window, task="mlp", steps=100_000, log_every=5, eval_every=0)
    qtbot.mouseClick(window.start_btn, Qt.LeftButton)
    wait_for_train_steps(qtbot, window, 2)
    qtbot.mouseClick(window.pause_btn, Qt.LeftButton)
    qtbot.waitUntil(lambda: any(e.get("event") == "paused" for e in window.plots.data.events), timeout=30_000)
    assert window.pause_btn.text() == "Resume"
    rows = window.plots.data.train.rows
    time.sleep(0.5)
    qtbot.wait(100)
    assert window.plots.data.train.rows == rows  # nothing trains while paused
    qtbot.mouseClick(window.pause_btn, Qt.LeftButton)
    wait_for_train_steps(qtbot, window, rows + 2)
    qtbot.mouseClick(window.stop_btn, Qt.LeftButton)
    result = wait_finished(qtbot, window, 60_000)
    assert result["status"] == "stopped"
    status = json.loads((Path(result["run_dir"]) / "status.json").read_text())
    assert status["state"] == "stopped"
    events = [e["event"] for e in read_metrics(result["run_dir"]) if e["kind"] == "event" and e["event"] != "warning"]
    assert events[:4] == ["started", "paused", "resumed", "stopped"]


def test_closing_the_window_mid_run_stops_cleanly_and_keeps_the_metrics(qtbot, tmp_path):
    settings = QSettings(str(tmp_path / "settings.ini"), QSettings.IniFormat)
    w = MainWindow(settings)
    w.form.editors["run.runs_dir"].widget.setText(str(tmp_path / "runs"))
    w.devices.set_checked(["cpu:0", "cpu:1"])
    w.separate.setChecked(False)  # in the app's thread (tests/test_gui_child.py closes on a child)
    configure(w, task="mlp", steps=100_000, log_every=5, eval_every=0)
    w.show()
    w.start()
    wait_for_train_steps(qtbot, w, 2)
    w.confirm_close = lambda: "stop"  # the user answers "Stop and quit"
    thread = w.run.thread
    assert w.close()
    assert not thread.isRunning()
    (run,) = list((tmp_path / "runs").iterdir())
    assert json.loads((run / "status.json").read_text())["state"] == "stopped"
    logged = [r["step"] for r in read_metrics(run) if r["kind"] == "train"]
    assert logged and logged == sorted(logged)
    assert (run / "checkpoints/last.pt").exists()


def test_closing_can_be_cancelled(qtbot, window):
    configure(window, task="mlp", steps=100_000, log_every=5, eval_every=0)
    window.show()
    window.start()
    wait_for_train_steps(qtbot, window, 1)
    window.confirm_close = lambda: "cancel"
    assert not window.close()
    assert window.is_running()


def test_a_task_that_raises_in_forward_shows_the_error_and_the_next_run_works(qtbot, window, tmp_path):
    task = tmp_path / "broken_task.py"
    task.write_text(BROKEN_TASK)
    configure(window, task=str(task), steps=5, log_every=1)
    result = start_and_wait(qtbot, window)
    assert result["status"] == "failed"
    assert "Caught ValueError in replica" in result["message"] and "my model is broken" in result["message"]
    assert window.error_box.isVisible() and "my model is broken" in window.error_box.detailedText()
    assert "Failed: task broken, step 1:" in window.status_label.text()
    window.error_box.close()
    configure(window, task="linear", steps=5, log_every=1)
    assert start_and_wait(qtbot, window)["status"] == "finished"


def test_a_task_rejected_at_setup_says_why_without_blocking(qtbot, window, tmp_path):
    task = tmp_path / "no_params.py"
    task.write_text(NO_PARAMS_TASK)
    configure(window, task=str(task), steps=3, log_every=1)
    result = start_and_wait(qtbot, window)
    assert result["status"] == "rejected" and "empty parameter list" in result["message"]
    assert "Not started" in window.status_label.text() and window.error_box.isVisible()
    assert window.start_btn.isEnabled()


def test_a_broken_task_file_is_marked_at_the_field(window, tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def nope(:\n")
    window.form.set_task(str(bad))
    window.validate()
    assert not window.start_btn.isEnabled()
    assert "syntax error at line 1" in window.why.text()


def test_open_a_past_run_and_overlay_another(qtbot, window):
    configure(window, steps=6, log_every=1)
    first = start_and_wait(qtbot, window)["run_dir"]
    configure(window, steps=8, log_every=1)
    second = start_and_wait(qtbot, window)["run_dir"]
    assert window.open_run(first)
    assert window.plots.data.train.rows == 6
    assert window.open_run(second, compare=True)
    window.plots.refresh()
    ((overlay, _),) = window.plots.overlays
    assert overlay.name == Path(second).name
    assert len(window.plots._curves["cmp1:loss"].yData) == 8  # the compared run, in every panel
    text = window.plots.show_values_at(3)
    assert text.startswith("step 3 ·") and "train loss" in text and "cpu:0 loss" in text


def test_presets_and_the_remembered_config(qtbot, window, tmp_path):
    window.form.editors["optim.lr"].widget.setText("0.05")
    window.form.set_task("mlp", {"width": 64})
    window.save_preset(str(tmp_path / "p.toml"))
    window.form.editors["optim.lr"].widget.setText("0.1")
    window.load_preset(str(tmp_path / "p.toml"))
    assert window.form.editors["optim.lr"].widget.text() == "0.05"
    assert window.form.param_editors["width"].widget.value() == 64
    configure(window, task="linear", steps=3, log_every=1)
    start_and_wait(qtbot, window)
    again = MainWindow(window.settings)
    qtbot.addWidget(again)
    assert again.form.values()["task"]["name"] == "linear"
    assert again.form.editors["train.steps"].widget.value() == 3


def test_smoothing_draws_the_ema_with_the_raw_curve_faint_behind(qtbot, window):
    configure(window, steps=30, log_every=1)
    start_and_wait(qtbot, window)
    raw_before = list(window.plots._curves["loss"].yData)
    window.smooth.setValue(80)
    window.plots.refresh()
    smoothed = window.plots._curves["loss"].yData
    faint = window.plots._raw["loss"]
    assert faint.isVisible() and list(faint.yData) == raw_before
    from multilane.gui.plots.decimate import ema

    assert list(smoothed) == pytest.approx(list(ema(np.array(raw_before), 0.8)))
    key = re.sub(r"<[^>]+>", "", window.plots.key.text)  # what the key shows, not its links
    assert all(key.count(name) == 1 for name in ("combined", "cpu:0", "cpu:1", "validation", "smoothed"))
    assert window.plots.loss.legend is None  # no legend on the data
    assert sorted(k for k in window.plots._curves if k.startswith("loss")) == ["loss", "loss/cpu:0", "loss/cpu:1"]
    lane1 = window.plots.data.train.get("loss/cpu:1")
    assert list(window.plots._curves["loss/cpu:1"].yData) == pytest.approx(list(ema(lane1, 0.8)))
    assert smoothed[0] == raw_before[0] and smoothed[-1] != raw_before[-1]
    assert np.std(np.diff(smoothed)) < np.std(np.diff(raw_before))  # smoother
    window.log_y.setChecked(True)
    assert window.plots.loss.ctrl.logYCheck.isChecked()


def test_the_x_axis_follows_the_data_until_the_user_zooms(qtbot, window):
    configure(window, steps=40, log_every=1)
    start_and_wait(qtbot, window)
    lo, hi = window.plots.loss.vb.viewRange()[0]
    assert lo <= 1 and hi >= 40 and window.plots.auto_x
    assert window.plots.metric_plot.vb.viewRange()[0] == pytest.approx([lo, hi])  # one x range for all
    window.plots.util.setXRange(10, 20, padding=0)  # the user zooms one plot
    assert window.plots.loss.vb.viewRange()[0] == pytest.approx([10, 20])
    assert not window.plots.auto_x and not window.auto_range.isChecked()
    window.plots.refresh()
    assert window.plots._curves["loss"].xData.min() >= 9  # only what is in view is drawn
    window.auto_range.setChecked(True)
    assert window.plots.auto_x and window.plots.loss.vb.viewRange()[0][1] >= 40


def test_switching_the_x_axis_to_wall_time(qtbot, window):
    configure(window, steps=6, log_every=1)
    start_and_wait(qtbot, window)
    window.x_mode.setCurrentText("time")
    window.plots.refresh()
    xs = window.plots._curves["loss"].xData
    assert xs[0] >= 0 and xs[-1] < 60 and list(xs) == sorted(xs)


@pytest.mark.slow
def test_training_yields_to_the_window_while_it_repaints_and_not_when_told_not_to(qtbot, window):
    from multilane.gui.runs.redraw_pace import RedrawPace

    window.redraw_pace = RedrawPace(cores=1000)  # redraws at 10 Hz, as on a big machine: a short run sees some
    configure(window, task="mlp", steps=150, log_every=1)
    window.show()
    qtbot.waitExposed(window)
    assert window.hold_action.isChecked()  # the default
    assert start_and_wait(qtbot, window)["status"] == "finished"
    assert window.run.control.held_s > 0  # some repaints held the next step
    window.hold_action.trigger()
    assert not window.hold_for_redraw
    assert window.settings.value("hold_for_redraw", type=bool) is False
    assert start_and_wait(qtbot, window)["status"] == "finished"
    assert window.run.control.held_s == 0


@pytest.mark.slow
def test_a_window_that_does_not_paint_does_not_hold_training(qtbot, window):
    # Never shown (like a minimized window): no paint ends a hold, so at most one hold, which
    # ends by itself, is taken.
    from multilane.gui.window.run_control import HOLD_MAX_S

    configure(window, task="mlp", steps=150, log_every=1)
    assert start_and_wait(qtbot, window)["status"] == "finished"
    assert window.run.control.held_s <= HOLD_MAX_S + 0.05


def test_the_worker_runs_synchronously_too(qtbot, tmp_path):
    # As napari does: call the work function in this thread once, so coverage sees it.
    from multilane.engine.config import build_config

    cfg = build_config(
        {
            "task": {"name": "linear"},
            "devices": {"use": "cpu:0"},
            "train": {"steps": 3},
            "run": {"runs_dir": str(tmp_path)},
        }
    )
    w = TrainWorker(cfg)
    got = []
    w.record.connect(got.append)
    with qtbot.waitSignal(w.finished) as blocker:
        w.run()
    assert blocker.args[0]["status"] == "finished" and any(r["kind"] == "train" for r in got)


@pytest.mark.slow
def test_multilane_export_headless_makes_the_same_files(qtbot, window, tmp_path):
    configure(window, steps=6, log_every=1)
    run_dir = start_and_wait(qtbot, window)["run_dir"]
    out = tmp_path / "cli-out"
    r = subprocess.run(
        [sys.executable, "-m", "multilane.engine.cli", "export", run_dir, "--out", str(out), "--width", "800"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert {"loss.png", "plots.png", "loss.svg", "metrics.csv"} <= {p.name for p in out.iterdir()}
    assert QImage(str(out / "loss.png")).width() == 800
    bad = subprocess.run(
        [sys.executable, "-m", "multilane.engine.cli", "export", str(tmp_path), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "not a run folder" in bad.stderr
