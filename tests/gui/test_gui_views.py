"""Telling runs apart and reading the plots right: the window, offscreen, driven as a user would."""

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("PySide6")

from multilane.gui.plots.palette import COMBINED, VALIDATION, series_color
from PySide6.QtCore import QEvent, Qt
from test_gui import configure, start_and_wait, wait_finished, wait_for_train_steps


def pen_color(item) -> str:
    return item.opts["pen"].color().name().upper()


def test_a_failure_mid_run_names_the_same_step_in_the_status_and_the_message(qtbot, window, tmp_path):
    task = tmp_path / "fails_at_5.py"
    task.write_text(
        "from multilane.engine.tasks.builtin import LinearTask\n"
        "import torch\n"
        "class FailsAt5(LinearTask):\n"
        "    name = 'fails5'\n"
        "    def build_model(self):\n"
        "        calls = [0]\n"
        "        class M(torch.nn.Linear):\n"
        "            def forward(self, x):\n"
        "                calls[0] += 1\n"
        "                if calls[0] > 8:  # two lanes: steps 1-4 make 8 calls\n"
        "                    raise ValueError('broken at step 5')\n"
        "                return super().forward(x)\n"
        "        return M(10, 1)\n"
    )
    configure(window, task=str(task), steps=10, log_every=1)
    result = start_and_wait(qtbot, window)
    window.error_box.close()
    assert result["status"] == "failed" and result["step"] == 4  # four steps completed
    assert "step 5:" in result["message"]
    status = window.status_label.text()
    assert "step 5" in status and "step 4" not in status


def test_open_and_compare_name_each_run_in_its_own_colour(qtbot, window):
    configure(window, steps=6, log_every=1, eval_every=3)
    window.form.editors["optim.lr"].widget.setText("0.02")
    first = start_and_wait(qtbot, window)["run_dir"]
    configure(window, steps=8, log_every=1, eval_every=4)
    window.form.editors["optim.lr"].widget.setText("0.05")
    second = start_and_wait(qtbot, window)["run_dir"]
    assert window.open_run(first)
    # the form and the header now describe the opened run, not the last live one
    assert window.form.values()["optim"]["lr"] == pytest.approx(0.02)
    assert window.form.values()["train"]["steps"] == 6
    assert Path(first).name in window.plots.title_text and Path(second).name not in window.plots.title_text
    assert pen_color(window.plots._curves["loss"]) == COMBINED.upper()
    assert pen_color(window.plots._curves["val"]) == VALIDATION.upper()
    assert window.open_run(second, compare=True)
    p = window.plots
    assert Path(first).name in p.title_text and Path(second).name in p.title_text
    key = p.key.text
    assert Path(first).name in key and Path(second).name in key
    # each run in its own colour, and the settings that differ between them named in the key
    assert "lr 0.02" in key and "lr 0.05" in key and "steps 6" in key and "steps 8" in key
    loss_item, val_item = p._curves["cmp1:loss"], p._curves["cmp1:val"]
    base, other = pen_color(p._curves["cmp0:loss"]), pen_color(loss_item)
    assert base == series_color(0).upper() and other == series_color(1).upper()
    assert pen_color(val_item) == other and pen_color(p._curves["cmp0:val"]) == base  # validation: its run's colour
    assert VALIDATION.upper() not in (base, other) and not p._curves["loss/cpu:0"].isVisible()
    assert not p._curves["loss"].isVisible() and loss_item.isVisible()
    assert len(loss_item.yData) == 8
    text = p.show_values_at(3)  # comparing: every run named with its own values
    parts = text.split(" · ")
    assert parts[0] == "step 3" and [q.split(": ")[0] for q in parts[1:]] == [Path(first).name, Path(second).name]
    assert all("loss " in q for q in parts[1:])


def test_the_runs_table_lists_past_runs_sorts_them_and_compares_a_selection(qtbot, window):
    dirs = []
    for steps, lr in ((4, "0.05"), (6, "0.01"), (5, "0.02")):
        configure(window, steps=steps, log_every=1, eval_every=2)
        window.form.editors["optim.lr"].widget.setText(lr)
        dirs.append(start_and_wait(qtbot, window)["run_dir"])
    window.tabs.setCurrentWidget(window.runs_table)  # showing the tab reads the runs folder
    table = window.runs_table.table
    assert table.rowCount() == 3
    headers = [table.horizontalHeaderItem(c).text() for c in range(table.columnCount())]
    for col in ("status", "strategy", "lr", "steps", "loss", "best val", "training time"):
        assert col in headers
    lr_col, steps_col = headers.index("lr"), headers.index("steps")
    table.sortItems(lr_col, Qt.AscendingOrder)
    assert [table.item(r, lr_col).text() for r in range(3)] == ["0.01", "0.02", "0.05"]
    assert [table.item(r, steps_col).text() for r in range(3)] == ["6/6", "5/5", "4/4"]
    assert {table.item(r, headers.index("status")).text() for r in range(3)} == {"finished"}
    window.runs_table.select([dirs[0], dirs[2]])
    assert window.runs_table.compare_btn.isEnabled() and not window.runs_table.open_btn.isEnabled()
    qtbot.mouseClick(window.runs_table.compare_btn, Qt.LeftButton)
    shown = {window.plots.data.name} | {r.name for r, _ in window.plots.overlays}
    assert shown == {Path(dirs[0]).name, Path(dirs[2]).name}


def test_hover_log_y_and_the_x_range_after_the_run(qtbot, window):
    configure(window, steps=40, log_every=1, eval_every=10)
    start_and_wait(qtbot, window)
    p = window.plots
    lo, hi = p.loss.vb.viewRange()[0]
    assert hi <= 40 + 0.05 * 40 and lo <= 1  # no empty quarter after the last step
    # the hover header: names with units, and it clears when the mouse leaves
    text = p.show_values_at(20)
    assert "throughput" in text and "samples/s" in text and "learning rate" in text
    assert "samples_per_s" not in text and "util/" not in text
    assert "cpu:0 utilization" in text or p.data.telemetry.rows == 0
    p.leaveEvent(QEvent(QEvent.Leave))
    assert p.header.text == p.title_text and not any(line.isVisible() for line in p._lines)
    # log y keeps auto range on and the x range where it was
    window.log_y.setChecked(True)
    p.refresh()
    assert window.auto_range.isChecked() and p.auto_x
    assert p.loss.vb.viewRange()[0] == pytest.approx([lo, hi])
    window.log_y.setChecked(False)
    assert window.auto_range.isChecked()
    # learning rate and gradient norm are plotted
    assert len(p._curves["lr"].yData) == 40


def test_device_util_column_shows_lanes_only_while_they_run(qtbot, window):
    window.devices.update_idle()
    rows = {d.name: item for item, _, d in window.devices.items}
    assert all(item.text(3) == "–" for name, item in rows.items() if name.startswith("cpu:"))
    window._idle_tick()
    assert "CPU " in window.devices_label.text() and "busy" in window.devices_label.text()  # once, not per lane
    window.devices.update_from_telemetry({"devices": {"cpu:0": {"busy_pct": {"mean": 73.0}}}})
    assert rows["cpu:0"].text(3) == "73%" and rows["cpu:1"].text(3) == "–"


def test_a_warning_does_not_hide_the_final_state(qtbot, window):
    window.show()
    configure(window, steps=4, log_every=1)
    start_and_wait(qtbot, window)
    window._on_record({"kind": "event", "event": "warning", "message": "give cpu:1 a smaller share", "step": 4})
    assert "Finished at step 4" in window.status_label.text() and window.status_label.isVisible()
    assert "smaller share" in window.note_label.text()


def test_resume_from_a_run_folder_shows_its_earlier_curves_and_settings(qtbot, window):
    configure(window, task="mlp", steps=100_000, log_every=2, eval_every=0)
    window.form.editors["optim.lr"].widget.setText("0.004")
    qtbot.mouseClick(window.start_btn, Qt.LeftButton)
    wait_for_train_steps(qtbot, window, 3)
    window.stop()
    run_dir = wait_finished(qtbot, window, 60_000)["run_dir"]
    stopped_at = json.loads((Path(run_dir) / "status.json").read_text())["step"]
    window.form.editors["optim.lr"].widget.setText("0.1")  # the user changed the form meanwhile
    assert window.resume(run_dir)
    assert window.form.values()["optim"]["lr"] == pytest.approx(0.004)  # the run's own settings
    assert window.plots.data.train.rows >= 3  # the curve so far, not only what comes after
    wait_for_train_steps(qtbot, window, window.plots.data.train.rows + 2)
    window.stop()
    wait_finished(qtbot, window, 60_000)
    steps = list(window.plots.data.train.get("step"))
    assert steps[0] <= 2 and steps == sorted(steps) and steps[-1] > stopped_at


def test_gpu_power_and_temperature_plots_and_pause_bands_from_records(qtbot, window):
    # Records as a GPU run writes them (no GPU here: the records are what NVML telemetry produces).
    p = window.plots
    t0 = 1_700_000_000.0
    for s in range(1, 21):
        p.add_record({"kind": "train", "step": s, "wall_time": t0 + s, "loss": 1 / s, "device_loss": {"cuda:0": 1 / s}})
        dev = {"util_pct": {"mean": 90.0}, "mem_used_mb": 4000.0 + s, "power_w": 250.0, "temp_c": 70.0 + s / 10}
        p.add_record({"kind": "telemetry", "wall_time": t0 + s + 0.5, "step": s, "devices": {"cuda:0": dev}})
    p.add_record({"kind": "event", "event": "paused", "step": 10, "wall_time": t0 + 10.2})
    p.add_record({"kind": "event", "event": "resumed", "step": 10, "wall_time": t0 + 14.0})
    p.refresh()
    assert p.power is not None and p.temperature is not None
    assert list(p._curves["power/cuda:0"].yData[:3]) == [250.0] * 3
    assert p.memory.vb.viewRange()[1][0] == pytest.approx(0)  # memory from zero, not from 4,001 MiB
    assert len(p._pause_items) == len(p.plots)  # one dotted line per plot on the step axis
    window.x_mode.setCurrentText("time")
    p.refresh()
    (region, *_) = [item for _, item in p._pause_items]
    assert region.getRegion() == pytest.approx((9.2, 13.0))  # seconds since the first record
    text = p.show_values_at(5)
    assert "cuda:0 power 250 W" in text and re.search(r"cuda:0 temperature 7\d°C", text)
    assert "cuda:0 utilization 90%" in text and re.search(r"cuda:0 memory used 4,00\d MiB", text)
