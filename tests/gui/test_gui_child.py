"""Runs the app trains in a separate process (the default): real windows offscreen, real child processes."""

import json
import os
import signal
import time
from pathlib import Path

import pytest

pytest.importorskip("PySide6")

from helpers import BROKEN_TASK, NO_PARAMS_TASK
from multilane.engine.rundir.control_file import write_control
from multilane.engine.rundir.runlog import read_metrics
from PySide6.QtCore import Qt


@pytest.fixture
def window(make_window):
    return make_window(separate=True)


def configure(w, task="mlp", steps=100_000, log_every=5, eval_every=0):
    w.form.set_task(task)
    w.form.editors["train.steps"].widget.setValue(steps)
    w.form.editors["train.log_every"].widget.setValue(log_every)
    w.form.editors["train.eval_every"].widget.setValue(eval_every)
    assert w.validate() == [], w.why.text()


def rows(w) -> int:
    return w.plots.data.train.rows


def events(run_dir) -> list[str]:
    keep = {"started", "paused", "resumed", "stopped", "finished", "failed"}
    return [r["event"] for r in read_metrics(run_dir) if r["kind"] == "event" and r["event"] in keep]


def wait_done(qtbot, w, timeout=120_000):
    qtbot.waitUntil(lambda: not w.is_running(), timeout=timeout)
    return w.last_result


@pytest.mark.slow
def test_separate_process_is_the_default_and_the_plots_follow_the_childs_folder(qtbot, window, tmp_path):
    assert window.separate.isChecked() and window.separate.isEnabled()
    configure(window, task="linear", steps=30, log_every=3, eval_every=15)
    qtbot.mouseClick(window.start_btn, Qt.LeftButton)
    assert window.run.child is not None and window.run.child.proc.pid != os.getpid()
    assert "separate process" in window.status_label.text()
    result = wait_done(qtbot, window)
    assert result["status"] == "finished", result
    run_dir = Path(result["run_dir"])
    assert run_dir.parent == tmp_path / "runs"
    on_disk = [r for r in read_metrics(run_dir) if r["kind"] == "train"]
    window.plots.refresh()
    assert (
        [int(s) for s in window.plots.data.train.get("step")] == [r["step"] for r in on_disk] == list(range(3, 31, 3))
    )
    for dev in ("cpu:0", "cpu:1"):  # per-device loss, as the child logged it
        assert list(window.plots._curves[f"loss/{dev}"].yData) == pytest.approx(
            [r["device_loss"][dev] for r in on_disk]
        )
    assert list(window.plots._curves["val"].xData) == [15, 30]
    assert "Finished at step 30" in window.status_label.text()
    assert (run_dir / "console.log").exists()  # the child's console output, kept with the run
    assert json.loads((run_dir / "status.json").read_text())["state"] == "finished"


@pytest.mark.slow
def test_pause_resume_stop_through_the_control_file_then_resume_the_run(qtbot, window):
    configure(window)
    window.start()
    qtbot.waitUntil(lambda: rows(window) >= 2, timeout=90_000)
    qtbot.mouseClick(window.pause_btn, Qt.LeftButton)
    run_dir = Path(window.run_info["run_dir"])
    assert json.loads((run_dir / "control.json").read_text())["command"] == "pause"
    qtbot.waitUntil(lambda: any(e.get("event") == "paused" for e in window.plots.data.events), timeout=30_000)
    paused_at = rows(window)
    time.sleep(0.8)
    qtbot.wait(400)
    assert rows(window) == paused_at  # nothing trains while paused
    qtbot.mouseClick(window.pause_btn, Qt.LeftButton)
    qtbot.waitUntil(lambda: rows(window) >= paused_at + 2, timeout=60_000)
    qtbot.mouseClick(window.stop_btn, Qt.LeftButton)
    result = wait_done(qtbot, window, 60_000)
    assert result["status"] == "stopped", result
    assert events(run_dir)[:4] == ["started", "paused", "resumed", "stopped"]
    assert (run_dir / "checkpoints" / "last.pt").exists()
    stopped_at = result["step"]

    # Run > Resume from run folder: another child continues from the checkpoint; the window shows
    # the run's earlier curves once and the new steps after them.
    assert window.resume(str(run_dir))
    assert window.run.child is not None
    qtbot.waitUntil(lambda: window.plots.data.train.get("step")[-1] >= stopped_at + 10, timeout=90_000)
    steps = [int(s) for s in window.plots.data.train.get("step")]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)  # each step once
    window.stop()
    result = wait_done(qtbot, window, 60_000)
    assert result["status"] == "stopped"
    started = [r for r in read_metrics(run_dir) if r.get("event") == "started"]
    assert started[-1]["resumed_from_step"] == stopped_at


@pytest.mark.slow
def test_a_killed_child_shows_failed_and_the_folder_says_so(qtbot, window):
    configure(window)
    window.start()
    qtbot.waitUntil(lambda: rows(window) >= 2, timeout=90_000)
    child = window.run.child
    os.kill(child.proc.pid, signal.SIGKILL)
    result = wait_done(qtbot, window, 30_000)
    assert result["status"] == "failed"
    assert "killed (SIGKILL)" in result["message"]
    assert window.status_label.text().startswith("Failed: the training process was killed")
    assert window.error_box.isVisible()
    status = json.loads((Path(result["run_dir"]) / "status.json").read_text())
    assert status["state"] == "failed" and "SIGKILL" in status["message"]  # the app recorded it
    assert window.start_btn.isEnabled()


@pytest.mark.slow
def test_a_task_that_fails_in_its_set_up_is_one_line_and_its_folder_says_failed(qtbot, window, tmp_path):
    # The run folder exists before the task's code runs (a run stuck in its data() is seen and stopped),
    # so a crash there is recorded in it as any crash is: "failed", one line, the traceback in error.txt.
    task = tmp_path / "no_params.py"
    task.write_text(NO_PARAMS_TASK)
    configure(window, task=str(task), steps=3, log_every=1)
    window.start()
    result = wait_done(qtbot, window)
    assert result["status"] == "failed", result
    assert "empty parameter list" in result["message"] and "\n" not in result["message"]
    assert "Traceback" not in result["message"] and window.error_box.isVisible()
    (run,) = (tmp_path / "runs").iterdir()
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "failed" and "setup failed" in status["message"]
    assert "empty parameter list" in (run / "error.txt").read_text()


@pytest.mark.slow
def test_a_task_that_fails_mid_run_shows_the_error_and_its_traceback(qtbot, window, tmp_path):
    task = tmp_path / "broken_task.py"
    task.write_text(BROKEN_TASK)
    configure(window, task=str(task), steps=5, log_every=1)
    window.start()
    result = wait_done(qtbot, window)
    assert result["status"] == "failed" and "my model is broken" in result["message"]
    assert "my model is broken" in window.error_box.detailedText()  # error.txt's traceback


@pytest.mark.slow
def test_closing_the_app_stops_its_child_with_a_checkpoint(qtbot, window):
    configure(window)
    window.show()
    window.start()
    qtbot.waitUntil(lambda: rows(window) >= 2, timeout=90_000)
    child = window.run.child
    window.confirm_close = lambda: "stop"  # "Stop and quit"
    assert window.close()
    assert child.poll() is not None  # the process has ended
    run_dir = Path(window.run_info["run_dir"])
    assert json.loads((run_dir / "status.json").read_text())["state"] == "stopped"
    assert (run_dir / "checkpoints" / "last.pt").exists()


@pytest.mark.slow
def test_closing_the_app_can_leave_the_child_training(qtbot, window):
    configure(window)
    window.show()
    window.start()
    qtbot.waitUntil(lambda: rows(window) >= 2, timeout=90_000)
    child = window.run.child
    run_dir = Path(window.run_info["run_dir"])
    window.confirm_close = lambda: "keep"  # "Keep training and quit"
    try:
        assert window.close()
        assert not window.run.thread.isRunning()  # the window stopped following
        time.sleep(1.0)
        assert child.poll() is None  # the run goes on without the window
        assert json.loads((run_dir / "status.json").read_text())["state"] == "running"
        write_control(run_dir, "stop")  # as `multilane control RUN stop` or another window would
        assert child.wait(60)
    finally:
        child.proc.kill()
    assert json.loads((run_dir / "status.json").read_text())["state"] == "stopped"


@pytest.mark.slow
def test_a_config_the_child_refuses_is_one_line_not_a_traceback(qtbot, window):
    configure(window, task="linear", steps=3, log_every=1)
    window.form.editors["train.precision"].widget.setCurrentText("fp16")  # checked by the engine: CPU lanes
    window.start()
    result = wait_done(qtbot, window)
    assert result["status"] == "rejected", result
    assert result["message"].startswith("train.precision = fp16: fp16 needs a GPU"), result["message"]
    assert window.status_label.text() == f"Not started: {result['message']}"


def test_stop_while_the_child_is_still_setting_up_stops_it(qtbot, window):
    configure(window)
    window.start()
    window.stop()  # before its first step: its control file is not read yet, so a SIGTERM
    result = wait_done(qtbot, window, 60_000)
    assert result["status"] == "stopped", result  # by the CLI's own handler, or before it was set up
    assert window.run.child.poll() is not None
