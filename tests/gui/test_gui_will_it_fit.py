"""Will it fit, in the app: "Will it fit?" runs ``multilane plan`` on the form's settings in a child process
and the device picker shows each device's forecast against its free memory (CPU lanes: the RAM)."""

from __future__ import annotations

import pytest
from multilane.engine.config import build_config
from multilane.engine.plan.fit import plan_run
from multilane.engine.plan.forecast import gib
from multilane.engine.run.trainer import Trainer
from multilane.engine.tasks import make_task
from multilane.engine.telemetry.devices import parse_devices
from multilane.gui.window.device_picker import NEEDS, share_of


@pytest.mark.slow
def test_the_picker_shows_the_forecast_against_the_free_ram(qtbot, make_window, tmp_path, monkeypatch):
    monkeypatch.setenv("MULTILANE_FIT_CHECK", "1")
    w = make_window(("cpu:0", "cpu:1"))
    w.set_config(build_config({"task": {"name": "linear"}, "data": {"batch_size": 96}}), keep_runs_dir=True)
    w.devices.set_checked(["cpu:0", "cpu:1"])
    rows = {d.name: item for item, _, d in w.devices.items}
    assert rows["cpu:0"].text(NEEDS) == ""
    qtbot.mouseClick(w.fit.button, __import__("PySide6.QtCore", fromlist=["Qt"]).Qt.LeftButton)
    assert "measuring" in w.fit.verdict.text()
    qtbot.waitUntil(lambda: w.fit.forecast is not None or "⚠" in w.fit.verdict.text(), timeout=240_000)
    need = w.fit.forecast["needs"][0]
    assert need["name"] == "cpu" and w.fit.verdict.text() == "fits at batch 96"
    # What the picker shows is the forecast the same probe makes in this process (the CPU measure counts
    # tensor bytes exactly: the same model and batch give the same bytes), against the RAM available then.
    here = plan_run(build_config({"task": {"name": "linear"}, "data": {"batch_size": 96}, "devices": {"use": "cpu:0,cpu:1"}}),
                    make_task("linear", {}), parse_devices("cpu:0,cpu:1"), Trainer.for_probe)  # fmt: skip
    assert here.needs[0].need == need["need"]
    assert rows["cpu:0"].text(NEEDS) == f"{gib(need['need'])} · {share_of(need['need'], need['free'])}"
    assert f"{gib(need['free'])} RAM available" in rows["cpu:0"].toolTip(NEEDS)
    assert rows["cpu:1"].text(NEEDS) == "shared"
    assert "RAM available" in rows["cpu:0"].toolTip(NEEDS)
    # A changed setting makes the forecast stale: the column empties.
    w.devices.set_checked(["cpu:0"])
    assert rows["cpu:0"].text(NEEDS) == "" and w.fit.forecast is None


def test_the_end_of_run_summary_sets_the_measured_peak_beside_the_forecast():
    from multilane.gui.runs.run_summary import summarize_records
    from multilane.gui.window.summary_view import summary_html

    peaks = {"cpu": {"forecast": 5_734_892, "measured": 5_792_136}, "junk": "x", "bad": {"measured": True}}
    s = summarize_records([{"kind": "event", "event": "memory", "step": 3, "wall_time": 1.0, "peaks": peaks}])
    assert s.memory == ["peak tensor memory cpu: 5.5 MiB measured, 5.5 MiB forecast (-1.0%)"]
    assert "<br>peak tensor memory cpu: 5.5 MiB measured" in summary_html(s, "run")
    # A tiny model's peaks (under 1 MiB): the difference in bytes, as the CLI's summary gives it.
    tiny = {"cpu": {"forecast": 3_789, "measured": 30_413}}
    s = summarize_records([{"kind": "event", "event": "memory", "step": 3, "wall_time": 1.0, "peaks": tiny}])
    assert s.memory == ["peak tensor memory cpu: 29.7 KiB measured, 3.7 KiB forecast (-26.0 KiB)"]


def test_the_summary_shows_each_devices_memory_split_as_the_run_recorded_it(qtbot, tmp_path):
    """The window's summary splits each device's memory as the CLI's does (a real
    persistent run on two lanes: lane 0 holds the optimizer state, lane 1 its replica's parameters)."""
    from multilane.engine.run.trainer import Trainer
    from multilane.engine.rundir.runlog import read_metrics
    from multilane.engine.telemetry.memory_split import fmt_bytes
    from multilane.gui.window.summary_view import SummaryView

    cfg = build_config({"task": {"name": "mlp"}, "devices": {"use": "cpu:0,cpu:1", "strategy": "persistent"},
                        "train": {"steps": 4, "log_every": 2, "eval_every": 0}, "telemetry": {"enabled": False},
                        "run": {"runs_dir": str(tmp_path)}})  # fmt: skip
    result = Trainer(cfg).run()
    recorded = [r for r in read_metrics(result.run_dir) if r["kind"] == "train"][-1]["memory"]
    view = SummaryView()
    qtbot.addWidget(view)
    assert view.show_run(result.run_dir)
    shown = [line for line in view.text().splitlines() if line.startswith("memory cpu:")]
    assert shown == [
        f"memory {d}: params {fmt_bytes(m['params'])} · grads {fmt_bytes(m['grads'])} · optimizer {fmt_bytes(m['optimizer'])}"
        for d, m in recorded.items()
    ]
    assert recorded["cpu:0"]["optimizer"] > 0 and recorded["cpu:1"]["optimizer"] == 0 < recorded["cpu:1"]["params"]
    # Read from disk: a device whose parts are not byte counts is left out, never drawn as a number.
    from multilane.gui.runs.run_summary import split_lines

    junk = {"cpu:0": {"params": "x", "grads": 1, "optimizer": 1}, "cpu:1": [1], "cpu:2": dict(recorded["cpu:0"])}
    assert [line.split(":")[0] + ":" + line.split(":")[1] for line in split_lines(junk)] == ["memory cpu:2"]


@pytest.mark.slow
def test_the_picker_shows_an_fsdp_runs_forecast_per_process_and_its_shards(qtbot, make_window, monkeypatch):
    """fsdp: one process per lane; the RAM they share needs all of them, each one's
    need and the shards it keeps are in the tooltip."""
    from PySide6.QtCore import Qt

    monkeypatch.setenv("MULTILANE_FIT_CHECK", "1")
    w = make_window(("cpu:0", "cpu:1"))
    cfg = {"task": {"name": "mlp"}, "data": {"batch_size": 64}, "devices": {"strategy": "fsdp"}}
    w.set_config(build_config(cfg), keep_runs_dir=True)
    w.devices.set_checked(["cpu:0", "cpu:1"])
    rows = {d.name: item for item, _, d in w.devices.items}
    qtbot.mouseClick(w.fit.button, Qt.LeftButton)
    qtbot.waitUntil(lambda: w.fit.forecast is not None or "⚠" in w.fit.verdict.text(), timeout=240_000)
    assert w.fit.forecast["strategy"] == "fsdp" and w.fit.verdict.text() == "fits at batch 64"
    need = w.fit.forecast["needs"][0]
    assert rows["cpu:0"].text(NEEDS) == f"{gib(need['need'])} · {share_of(need['need'], need['free'])}"
    tip = rows["cpu:0"].toolTip(NEEDS)
    assert f"2 processes, each up to {gib(need['per_rank'])}" in tip
    assert f"shards per device {gib(need['shards'][0])} (whole: {gib(need['shards'][1])})" in tip
    assert rows["cpu:1"].text(NEEDS) == "shared"
