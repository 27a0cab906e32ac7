"""The window and a host over SSH (a real sshd on 127.0.0.1): the hosts list, the host's devices,
Start there, Stop, closing the window mid-run and a new window offering to follow the run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sshd_server import remote_window


def configure(w, task: str, steps: int, log_every: int, eval_every: int) -> None:
    w.form.set_task(task)
    w.form.editors["train.steps"].widget.setValue(steps)
    w.form.editors["train.log_every"].widget.setValue(log_every)
    w.form.editors["train.eval_every"].widget.setValue(eval_every)
    assert w.validate() == []


pytestmark = pytest.mark.timeout(900)


def test_the_hosts_list_holds_ssh_config_aliases_and_remembers_added_hosts(ssh_home, make_window, qtbot):
    w = make_window()
    hosts = [w.hosts.combo.itemText(i) for i in range(w.hosts.combo.count())]
    assert hosts[:3] == ["This computer", "testhost", "wrongkey"]
    w.hosts.add_host("me@gpu-box.example:2222")
    with pytest.raises(Exception, match=r"\[user@\]host\[:port\]"):
        w.hosts.add_host("not a host")
    w2 = make_window()
    assert w2.hosts.combo.findText("me@gpu-box.example:2222") > 0  # remembered


@pytest.mark.slow
def test_a_remote_run_started_from_the_window_is_followed_and_stopped(ssh_home, sshd, make_window, qtbot, tmp_path):
    w = remote_window(make_window, qtbot, sshd.runs)
    assert w.devices.host == "testhost" and [d.name for d in w.devices.selected()] == ["cpu:0", "cpu:1"]
    configure(w, task="linear", steps=10_000_000, log_every=5, eval_every=0)
    assert w.start()
    qtbot.waitUntil(lambda: w.plots.data.last_step > 50, timeout=300_000)
    mirror = Path(w.shown_run_dir)
    info = json.loads((mirror / "remote.json").read_text())
    assert Path(info["path"]).parent == sshd.runs  # the host's runs folder the panel names
    assert mirror.parent == tmp_path / "runs" and info["host"] == "testhost"
    w.stop()
    qtbot.waitUntil(lambda: not w.is_running(), timeout=240_000)
    assert w.last_result["status"] == "stopped"
    remote = Path(info["path"])
    assert json.loads((remote / "status.json").read_text())["state"] == "stopped"
    assert (mirror / "metrics.jsonl").read_bytes() == (remote / "metrics.jsonl").read_bytes()
    # the mirror is a run in the runs table, offline
    w.refresh_runs()
    row = next(r for r in w.runs_table.rows if r.path == mirror)
    assert row.status == "stopped" and row.task == "linear"


@pytest.mark.slow
def test_a_window_closed_mid_run_leaves_it_training_and_a_new_window_offers_to_follow_it(
    ssh_home, sshd, make_window, qtbot
):
    w = remote_window(make_window, qtbot, sshd.runs)
    configure(w, task="linear", steps=10_000_000, log_every=5, eval_every=0)
    assert w.start()
    qtbot.waitUntil(lambda: w.plots.data.last_step > 20, timeout=300_000)
    mirror = Path(w.shown_run_dir)
    remote = Path(json.loads((mirror / "remote.json").read_text())["path"])
    w.close()
    qtbot.waitUntil(lambda: not w.is_running(), timeout=60_000)
    seen = w.plots.data.last_step
    size = (remote / "metrics.jsonl").stat().st_size
    qtbot.waitUntil(lambda: (remote / "metrics.jsonl").stat().st_size > size + 1000, timeout=120_000)  # trains on
    w2 = make_window()
    box = w2.remote_offer
    assert box.isVisible() and mirror.name in box.text()
    next(b for b in box.buttons() if b.text() == "Follow").click()
    qtbot.waitUntil(lambda: w2.is_running() and w2.plots.data.last_step > seen + 50, timeout=300_000)
    w2.stop()
    qtbot.waitUntil(lambda: not w2.is_running(), timeout=240_000)
    assert w2.last_result["status"] == "stopped"
    assert (mirror / "metrics.jsonl").read_bytes() == (remote / "metrics.jsonl").read_bytes()
