"""The app follows runs other processes write: File > Follow run, and a ddp run it starts as a child."""

import json
import subprocess
import time

import pytest

pytest.importorskip("PySide6")

from helpers import CLI, start_long_cli_run
from multilane.engine.rundir.runlog import read_metrics


@pytest.fixture
def window(make_window):
    return make_window(separate=True)


def train_steps(w) -> list[int]:
    return [int(s) for s in w.plots.data.train.get("step").tolist()]


def test_follow_a_cli_run_live_and_stop_it_from_the_app(qtbot, window, tmp_path):
    runs = tmp_path / "cli-runs"
    proc = start_long_cli_run(runs, "train.log_every=5", "train.eval_every=0", stderr=subprocess.DEVNULL)
    try:
        qtbot.waitUntil(lambda: bool(list(runs.glob("*/metrics.jsonl"))), timeout=90_000)
        (run_dir,) = [p.parent for p in runs.glob("*/metrics.jsonl")]
        assert window.follow_run(str(run_dir))
        assert window.is_running()
        qtbot.waitUntil(lambda: len(train_steps(window)) >= 3, timeout=90_000)
        seen = train_steps(window)
        assert seen == sorted(seen) and len(set(seen)) == len(seen)
        window.stop()
        qtbot.waitUntil(lambda: not window.is_running(), timeout=90_000)
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    assert window.last_result["status"] == "stopped"
    on_disk = [r["step"] for r in read_metrics(run_dir) if r["kind"] == "train"]
    assert train_steps(window) == on_disk  # every record, each once
    assert json.loads((run_dir / "status.json").read_text())["state"] == "stopped"


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_ddp_run_started_from_the_app_runs_as_child_processes_and_shows_per_rank_loss(
    qtbot, window, tmp_path, strategy
):
    window.form.set_task("linear")
    window.form.editors["train.steps"].widget.setValue(12)
    window.form.editors["train.log_every"].widget.setValue(3)
    window.form.editors["train.eval_every"].widget.setValue(0)
    window.form.editors["devices.strategy"].widget.setCurrentText(strategy)
    assert window.form.editors["devices.strategy"].widget.currentText() == strategy  # a choice of the form
    assert window.separate.isChecked() and not window.separate.isEnabled()  # ddp and fsdp always run outside
    assert window.validate() == []
    t0 = time.monotonic()
    assert window.start()
    qtbot.waitUntil(lambda: not window.is_running(), timeout=180_000)
    assert window.last_result["status"] == "finished", window.last_result
    assert time.monotonic() - t0 < 180
    (run_dir,) = list((tmp_path / "runs").iterdir())
    assert json.loads((run_dir / "config.json").read_text())["devices"]["strategy"] == strategy
    assert train_steps(window) == [3, 6, 9, 12]
    assert sorted(k.split("/")[1] for k in window.plots.data.devices) == ["rank0", "rank1"]


@pytest.mark.slow
def test_a_followed_run_whose_process_is_killed_ends_with_one_line_saying_so(qtbot, window, tmp_path):
    """A SIGKILL leaves status.json at "running" for ever: the follower sees its writer is gone
    (the lock file names the pid and host) and ends, in the app and in ``multilane watch``."""
    runs = tmp_path / "cli-runs"
    proc = start_long_cli_run(runs, "train.log_every=5", "train.eval_every=0", stderr=subprocess.DEVNULL)
    try:
        qtbot.waitUntil(lambda: bool(list(runs.glob("*/metrics.jsonl"))), timeout=90_000)
        (run_dir,) = [p.parent for p in runs.glob("*/metrics.jsonl")]
        assert window.follow_run(str(run_dir))
        qtbot.waitUntil(lambda: len(train_steps(window)) >= 2, timeout=90_000)
    finally:
        proc.kill()
        proc.wait(timeout=60)
    qtbot.waitUntil(lambda: not window.is_running(), timeout=15_000)
    result = window.last_result
    assert result["status"] == "failed"
    assert f"pid {proc.pid}" in result["message"] and "no final status" in result["message"]
    assert json.loads((run_dir / "status.json").read_text())["state"] == "running"  # the folder is not ours
    watch = subprocess.run([*CLI, "watch", str(run_dir)], capture_output=True, text=True, timeout=30)
    assert watch.returncode == 1
    assert watch.stdout.strip().splitlines()[-1] == f"{run_dir.name}: {result['message']}"
