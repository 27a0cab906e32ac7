"""Run > Resume on a host, against a real sshd on 127.0.0.1: the host's run folders listed (newest first,
state and step), a run stopped midway there resumed from the window to its end, followed through its
mirror with no gap and no duplicate, equal to a straight run; a run still live there refused in one line."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from helpers import CLI
from multilane.engine.rundir.runlog import load_metrics, read_metrics
from sshd_server import remote_window

pytestmark = pytest.mark.timeout(900)
STEPS, LOG_EVERY, EVAL_EVERY = 3000, 5, 500
SAME = ("step", "loss", "device_loss", "lr", "epoch", "grad_norm")


def story(run_dir):
    recs = load_metrics(run_dir).records
    train = [{k: r.get(k) for k in SAME} for r in recs if r["kind"] == "train"]
    evals = [(r["step"], r["val_loss"], r["metrics"]) for r in recs if r["kind"] == "eval"]
    return train, evals


def the_list(qtbot, w):
    box = w.remote_resume_box
    qtbot.waitUntil(lambda: box.rows is not None, timeout=120_000)
    return box


@pytest.mark.slow
def test_a_run_stopped_there_resumes_from_the_window_to_its_end_as_a_straight_run(
    ssh_home, sshd, make_window, qtbot, tmp_path
):
    w = remote_window(make_window, qtbot, sshd.runs)
    assert w.resume_action.text() == "Resume a run on testhost…"
    w.form.set_task("linear")
    w.form.editors["train.steps"].widget.setValue(STEPS)
    w.form.editors["train.log_every"].widget.setValue(LOG_EVERY)
    w.form.editors["train.eval_every"].widget.setValue(EVAL_EVERY)
    assert w.start()
    w.toggle_pause()  # given before it trains: written there once it does, so it pauses well before its end
    qtbot.waitUntil(lambda: any(e.get("event") == "paused" for e in w.plots.data.events), timeout=300_000)
    w.stop()
    qtbot.waitUntil(lambda: not w.is_running(), timeout=240_000)
    assert w.last_result["status"] == "stopped"
    mirror = Path(w.shown_run_dir)
    remote = Path(json.loads((mirror / "remote.json").read_text())["path"])
    stopped_at = json.loads((remote / "status.json").read_text())["step"]
    assert 0 < stopped_at < STEPS and (remote / "checkpoints" / "last.pt").exists()

    # Run > Resume a run on testhost…: the list, newest first, with the run's state and step
    w.resume_dialog()
    box = the_list(qtbot, w)
    assert box.isVisible() and box.windowTitle() == "Resume a run on testhost"
    item = box.tree.topLevelItem(0)
    assert item.text(0) == remote.name and item.text(1) == "stopped"
    assert item.text(2) == f"{stopped_at} / {STEPS}" and item.text(3) == "yes"
    assert box.resume_btn.isEnabled()
    box.resume_btn.click()
    qtbot.waitUntil(lambda: w.is_running(), timeout=10_000)
    qtbot.waitUntil(lambda: not w.is_running(), timeout=600_000)
    assert w.last_result["status"] == "finished", w.last_result
    assert Path(w.shown_run_dir) == mirror  # the same mirror goes on
    assert w.plots.data.last_step == STEPS
    steps = [int(s) for s in w.plots.data.train.get("step")]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)  # the curves so far, then the new steps

    # the mirror equals the run there byte for byte; its story has every step once
    assert (mirror / "metrics.jsonl").read_bytes() == (remote / "metrics.jsonl").read_bytes()
    started = [r for r in read_metrics(mirror) if r.get("event") == "started"]
    assert started[-1]["resumed_from_step"] == stopped_at
    train, _ = story(mirror)
    assert [r["step"] for r in train] == list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))

    # a straight run of the same config on the same machine tells the same story
    config = json.loads((mirror / "config.json").read_text())
    config["run"]["runs_dir"] = str(tmp_path / "straight")
    (tmp_path / "straight.json").write_text(json.dumps(config))
    p = subprocess.run([*CLI, "train", "--config", str(tmp_path / "straight.json")], capture_output=True, timeout=600)
    assert p.returncode == 0, p.stderr
    (straight,) = (tmp_path / "straight").iterdir()
    assert story(mirror) == story(straight)


@pytest.mark.slow
def test_a_run_still_live_there_is_marked_in_the_list_and_refused_in_one_line(
    ssh_home, sshd, make_window, qtbot, tmp_path
):
    runs = sshd.runs / "live"
    args = ["train", "--task", "linear", "--steps", "10000000", "--runs-dir", str(runs), "--name", "live"]
    live = subprocess.Popen([*CLI, *args, "--set", "train.checkpoint_every=100"], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while not list(runs.glob("*/checkpoints/last.pt")) and time.monotonic() < deadline:
            time.sleep(0.5)
        (folder,) = [p for p in runs.iterdir() if not p.name.startswith(".")]
        w = remote_window(make_window, qtbot, runs)
        w.resume_dialog()
        box = the_list(qtbot, w)
        item = box.tree.topLevelItem(0)
        assert item.text(0) == folder.name and item.text(1) == f"running (live, pid {live.pid})"
        assert not box.resume_btn.isEnabled() and "still training there" in box.message.text()
        box.reject()

        # the list was read a moment ago; Resume anyway (say, from another window): refused, one line
        before = sorted(p.name for p in folder.iterdir())
        size = (folder / "console.log").stat().st_size if (folder / "console.log").exists() else 0
        assert w.resume_remote(str(folder))
        qtbot.waitUntil(lambda: not w.is_running(), timeout=120_000)
        assert w.last_result["status"] == "rejected"
        line = f"testhost: run {folder} is in use by pid {live.pid} there; one run writes to a folder at a time"
        assert w.last_result["message"].startswith(line) and "\n" not in w.last_result["message"]
        assert w.status_label.text().startswith(f"Not started: {line}")
        assert sorted(p.name for p in folder.iterdir()) == before  # nothing started there
        assert ((folder / "console.log").stat().st_size if (folder / "console.log").exists() else 0) == size
        assert live.poll() is None
    finally:
        live.terminate()
        live.wait(60)
