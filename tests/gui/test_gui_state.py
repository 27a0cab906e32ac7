"""Every run's state true in the window: a followed paused run, training time, the summary at a run's
end, the remembered form, the run name, opening a run over an edited form, and the small things."""

import json
import re
import subprocess
import time
from pathlib import Path

import pytest

pytest.importorskip("PySide6")

from helpers import start_long_cli_run
from multilane.engine.rundir.control_file import write_control
from multilane.engine.rundir.runlog import iter_metrics, read_metrics
from multilane.engine.rundir.runs_folder import run_folder_problem
from multilane.gui.runs.run_summary import TrainingClock, fmt_duration
from multilane.gui.window.main_window import MainWindow
from PySide6.QtCore import QSettings, QTimer
from PySide6.QtWidgets import QApplication, QMessageBox
from test_gui import configure, start_and_wait, wait_finished, wait_for_train_steps


def _training_time(text: str) -> float:
    m = re.search(r"training time (\d+(?:\.\d+)? s|\d+:\d\d(?::\d\d)?)", text)
    assert m, text
    t = m.group(1)
    if t.endswith(" s"):
        return float(t[:-2])
    parts = [int(x) for x in t.split(":")]
    return float(sum(v * 60**i for i, v in enumerate(reversed(parts))))


@pytest.mark.slow
def test_following_a_run_that_is_already_paused_shows_it_paused(qtbot, make_window, tmp_path):
    window = make_window(separate=True)
    runs = tmp_path / "cli-runs"
    proc = start_long_cli_run(runs, "train.log_every=5", "train.eval_every=0", stderr=subprocess.DEVNULL)
    try:
        qtbot.waitUntil(lambda: bool(list(runs.glob("*/metrics.jsonl"))), timeout=90_000)
        (run_dir,) = [p.parent for p in runs.glob("*/metrics.jsonl")]
        qtbot.waitUntil(
            lambda: any(r["kind"] == "train" for r in iter_metrics(run_dir / "metrics.jsonl")), timeout=90_000
        )
        write_control(run_dir, "pause")  # paused by someone else, before the window follows it
        status = run_dir / "status.json"
        qtbot.waitUntil(lambda: json.loads(status.read_text())["state"] == "paused", timeout=60_000)
        assert window.follow_run(str(run_dir))
        qtbot.waitUntil(lambda: window.status_label.text().startswith("Paused"), timeout=30_000)
        assert window.pause_btn.text() == "Resume" and window.paused
        text = window.status_label.text()
        assert "ETA" not in text and "samples/s" not in text and "training time" in text
        window.toggle_pause()  # Resume from the window: the run trains again, and the window says so
        qtbot.waitUntil(lambda: "ETA" in window.status_label.text(), timeout=60_000)
        assert window.pause_btn.text() == "Pause"
        # status.json is rewritten at the run's next log step, which may come after the record the label shows
        qtbot.waitUntil(lambda: json.loads(status.read_text())["state"] == "running", timeout=30_000)
        write_control(run_dir, "pause")  # paused again from outside while followed
        qtbot.waitUntil(lambda: window.pause_btn.text() == "Resume", timeout=60_000)
        window.stop()
        qtbot.waitUntil(lambda: not window.is_running(), timeout=90_000)
    finally:
        proc.kill()
        proc.wait(timeout=60)


def test_training_time_leaves_out_the_time_a_run_sat_stopped_in_the_window_and_the_runs_table(qtbot, window):
    configure(window, task="mlp", steps=100_000, log_every=2, eval_every=0)
    window.start()
    wait_for_train_steps(qtbot, window, 3)
    window.stop()
    run_dir = Path(wait_finished(qtbot, window, 60_000)["run_dir"])
    # The run sat stopped for 1,000 s before its resume: its first stretch is moved back in time.
    metrics = run_dir / "metrics.jsonl"
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    for rec in lines:
        rec["wall_time"] -= 1000
    metrics.write_text("".join(json.dumps(r) + "\n" for r in lines))
    before = TrainingClock.of(lines).seconds()
    assert 0 < before < 100
    assert window.resume(str(run_dir))
    wait_for_train_steps(qtbot, window, window.plots.data.train.rows + 2)
    window.toggle_pause()
    qtbot.waitUntil(lambda: window.status_label.text().startswith("Paused"), timeout=30_000)
    shown = _training_time(window.status_label.text())
    assert before - 0.1 <= shown < before + 100  # the time it trained before the resume, not the 1,000 s
    window.toggle_pause()
    window.stop()
    wait_finished(qtbot, window, 60_000)
    total = TrainingClock.of(iter_metrics(metrics)).seconds()
    assert before < total < before + 100
    window.tabs.setCurrentWidget(window.runs_table)
    (row,) = [r for r in window.runs_table.rows if r.path == run_dir]
    assert row.duration_s == pytest.approx(total)
    col = [k for k, _ in __import__("multilane.gui.table.runs_index", fromlist=["COLUMNS"]).COLUMNS].index("duration_s")
    (cell,) = [
        window.runs_table.table.item(r, col).text()
        for r in range(window.runs_table.table.rowCount())
        if window.runs_table.table.item(r, 0).text() == run_dir.name
    ]
    assert cell == fmt_duration(total) and f"training time {cell}" in window.summary.text()


def test_the_summary_at_a_runs_end_gives_final_and_best_values_and_their_steps(qtbot, window):
    configure(window, task="linear", steps=20, log_every=2, eval_every=4)
    result = start_and_wait(qtbot, window)
    assert result["status"] == "finished" and not window.summary.isHidden()
    records = read_metrics(result["run_dir"])
    evals = [r for r in records if r["kind"] == "eval"]
    best_val = min(evals, key=lambda r: r["val_loss"])
    best_r2 = max(evals, key=lambda r: r["metrics"]["r2"])  # r2: higher is better
    s = window.summary.summary
    assert s.series["val_loss"].best == best_val["val_loss"] and s.series["val_loss"].best_step == best_val["step"]
    assert s.series["r2"].best == best_r2["metrics"]["r2"] and s.series["r2"].best_step == best_r2["step"]
    assert s.series["val_loss"].final == evals[-1]["val_loss"]
    assert s.series["loss"].final == [r for r in records if r["kind"] == "train"][-1]["loss"]
    text = window.summary.text()
    assert "finished all 20 steps" in text and "samples/s" in text and "training time" in text
    assert s.samples_per_s > 0


def test_a_stopped_run_says_its_step_once_and_why_it_stopped(qtbot, window):
    configure(window, task="mlp", steps=100_000, log_every=5, eval_every=0)
    window.start()
    wait_for_train_steps(qtbot, window, 2)
    window.stop()
    result = wait_finished(qtbot, window, 60_000)
    text = window.status_label.text()
    assert text.lower().count("stopped at step") == 1, text
    assert text.startswith(f"Stopped at step {result['step']:,}")
    assert f"stopped at step {result['step']:,}" in window.summary.text()


def test_the_form_is_remembered_as_it_was_at_quit_not_as_at_the_last_start(qtbot, tmp_path):
    settings = str(tmp_path / "settings.ini")
    w = MainWindow(QSettings(settings, QSettings.IniFormat))
    qtbot.addWidget(w)
    (tmp_path / "a-file").write_text("x")
    bad = tmp_path / "a-file" / "runs"
    w.devices.set_checked(["cpu:0", "cpu:1"])
    w.separate.setChecked(False)
    configure(w, task="linear", steps=5)
    w.form.editors["run.runs_dir"].widget.setText(str(bad))
    w.start()  # refused at Start: the runs folder cannot be made
    qtbot.waitUntil(lambda: not w.is_running(), timeout=30_000)
    assert w.last_result["status"] == "rejected"
    w.form.editors["run.runs_dir"].widget.setText(str(tmp_path / "runs"))  # fixed, then quit
    w.form.editors["train.steps"].widget.setValue(77)
    w.form.editors["optim.lr"].widget.setText("0.5x")  # even a value not valid yet comes back as typed
    w.close()
    again = MainWindow(QSettings(settings, QSettings.IniFormat))
    qtbot.addWidget(again)
    assert again.form.editors["run.runs_dir"].widget.text() == str(tmp_path / "runs")
    assert again.form.editors["train.steps"].widget.value() == 77
    assert again.form.editors["optim.lr"].widget.text() == "0.5x"
    assert again.form.values()["task"]["name"] == "linear"


def test_the_run_name_follows_the_task_it_names(window):
    name = window.form.editors["run.name"].widget
    combo = window.form.task_combo
    combo.setCurrentText("digits")
    combo.activated.emit(combo.currentIndex())
    name.setText("digits-b")
    combo.setCurrentText("charlm")
    combo.activated.emit(combo.currentIndex())  # the user picks another task
    assert name.text() == "charlm-b"
    name.setText("lr-sweep")  # a name that does not name the task stays
    combo.setCurrentText("mlp")
    combo.activated.emit(combo.currentIndex())
    assert name.text() == "lr-sweep"


def _answer_next_box(button_text: str, seen: list) -> None:
    """Click ``button_text`` in the next modal message box, as a user would (gives up after 20 s)."""
    deadline = time.monotonic() + 20

    def click() -> None:
        box = QApplication.activeModalWidget()
        if not isinstance(box, QMessageBox) or button_text not in [b.text() for b in box.buttons()]:
            if time.monotonic() < deadline:
                QTimer.singleShot(50, click)
            return
        seen.append(box.text())
        (button,) = [b for b in box.buttons() if b.text() == button_text]
        button.click()

    QTimer.singleShot(50, click)


def test_opening_a_run_over_an_edited_form_asks_before_replacing_it(qtbot, window):
    del window.ask_replace_form  # the real question (the fixture answers it for other tests)
    configure(window, task="linear", steps=6)
    run_dir = start_and_wait(qtbot, window)["run_dir"]
    window.form.editors["train.steps"].widget.setValue(55)  # the user edits the form
    seen: list = []
    _answer_next_box("Keep my settings", seen)
    assert window.open_run(run_dir)
    assert seen and "changed" in seen[0]
    assert window.form.editors["train.steps"].widget.value() == 55  # kept; the run's curves are shown
    assert window.shown_run_dir == run_dir
    _answer_next_box("Show the run's settings", seen)
    assert window.open_run(run_dir)
    assert window.form.editors["train.steps"].widget.value() == 6
    assert window.open_run(run_dir)  # nothing edited since: no question
    assert len(seen) == 2


@pytest.mark.slow
def test_open_run_on_a_folder_that_is_not_a_run_says_what_the_cli_says(qtbot, window, tmp_path):
    from helpers import CLI

    folder = tmp_path / "not-a-run"
    folder.mkdir()
    seen: list = []
    _answer_next_box("OK", seen)
    assert not window.open_run(str(folder))
    assert seen == [run_folder_problem(folder)]
    cli = subprocess.run([*CLI, "export", str(folder), "--out", str(tmp_path / "o")], capture_output=True, text=True)
    assert cli.returncode == 2 and cli.stderr.strip() == f"multilane: error: export: {seen[0]}"


def test_an_unwritable_runs_folder_is_refused_at_start_before_any_set_up(qtbot, window, tmp_path):
    marker = tmp_path / "data-was-built"
    task = tmp_path / "slow_setup.py"
    task.write_text(
        "from pathlib import Path\n"
        "from multilane.engine.tasks.builtin import LinearTask\n"
        "class SlowSetup(LinearTask):\n"
        "    name = 'slow_setup'\n"
        "    def data(self):\n"
        f"        Path({str(marker)!r}).write_text('set-up ran')\n"
        "        return super().data()\n"
    )
    (tmp_path / "a-file").write_text("x")
    configure(window, task=str(task), steps=5)
    window.form.editors["run.runs_dir"].widget.setText(str(tmp_path / "a-file" / "runs"))
    window.start()
    qtbot.waitUntil(lambda: not window.is_running(), timeout=30_000)
    assert window.last_result["status"] == "rejected"
    assert "runs folder" in window.last_result["message"] and "not writable" in window.last_result["message"]
    assert not marker.exists()  # said before the task's data was built
    if window.error_box is not None:
        window.error_box.close()


@pytest.mark.slow
def test_the_app_lists_the_cpu_lanes_multilane_devices_lists(window):
    from helpers import CLI

    if window.devices.gpus:
        pytest.skip("a GPU machine lists its GPUs")
    r = subprocess.run([*CLI, "devices", "--json"], capture_output=True, text=True, timeout=300)
    (cpu,) = [d for d in json.loads(r.stdout) if d["kind"] == "cpu"]
    names = [d.name for _, _, d in window.devices.items]
    assert names == [f"cpu:{i}" for i in range(cpu["lanes"])]
    assert cpu["lanes"] == max(2, min(8, cpu["cores"]))


def test_training_time_counts_training_only_not_set_up_pauses_or_the_time_between_a_stop_and_a_resume():
    records = [
        {"kind": "event", "event": "started", "wall_time": 100.0},
        {"kind": "train", "step": 1, "wall_time": 101.0},
        {"kind": "telemetry", "wall_time": 105.0},
        {"kind": "event", "event": "paused", "wall_time": 106.0},
        {"kind": "telemetry", "wall_time": 140.0},  # while paused: not training
        {"kind": "event", "event": "resumed", "wall_time": 156.0},
        {"kind": "train", "step": 2, "wall_time": 160.0},  # then killed: no final event
        {"kind": "event", "event": "started", "wall_time": 1000.0, "resumed_from_step": 1},
        {"kind": "train", "step": 2, "wall_time": 1002.0},
        {"kind": "event", "event": "finished", "wall_time": 1003.0},
    ]
    assert TrainingClock.of(records).seconds() == pytest.approx(6 + 4 + 3)
    live = TrainingClock.of(records[:8])  # training again since 1000
    assert live.seconds(now=1010.0) == pytest.approx(6 + 4 + 10)
    paused = TrainingClock.of(records[:4])
    assert paused.seconds(now=5000.0) == pytest.approx(6)  # a paused run's clock stands still
    assert [fmt_duration(s) for s in (4.25, 59.9, 61, 3725)] == ["4.2 s", "59.9 s", "1:01", "1:02:05"]


def test_the_fsdp_options_are_short_labels_and_greyed_unless_the_strategy_is_fsdp(window):
    form = window.form
    box = form.sections["devices"]
    labels = {box.labelForField(form.editors[k].row).text() for k in ("devices.fsdp_activation_checkpointing",
                                                                     "devices.fsdp_cpu_offload")}  # fmt: skip
    assert labels == {"fsdp recompute", "fsdp CPU offload"}  # the field names would widen the whole form
    strategy = form.editors["devices.strategy"]
    for choice, on in (("ddp", False), ("fsdp", True), ("replicate", False)):
        strategy.set(choice)
        form._changed()
        for key in ("devices.fsdp_activation_checkpointing", "devices.fsdp_cpu_offload"):
            assert form.editors[key].widget.isEnabled() is on, (choice, key)
