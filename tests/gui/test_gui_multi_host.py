"""The window and two hosts (two ssh config aliases of the real sshd on 127.0.0.1, each with its own
runs folder): devices picked on both are remembered per host, a line says they make one ddp run
across them, and Start launches that run and follows it through the first host's run folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PySide6.QtCore import Qt
from sshd_server import MULTILANE, add_host_alias

# One xdist group for the tests that start `--node-rank` launchers: some assert that none is left on the machine.
pytestmark = [pytest.mark.timeout(900), pytest.mark.xdist_group("node-rank")]


def pick_host(w, qtbot, host: str, runs: Path) -> None:
    """The user picks ``host`` in the host bar (its command and runs folder there already typed once)."""
    w.settings.setValue(f"remote/command/{host}", MULTILANE)
    w.settings.setValue(f"remote/runs/{host}", str(runs))
    w.hosts.combo.setCurrentText(host)
    qtbot.waitUntil(lambda: w.hosts.message.text() == f"devices of {host}" and w.devices.host == host, timeout=240_000)


def click(w, name: str, on: bool) -> None:
    """What a click on a device's box does (the tree's signal, as from the mouse)."""
    item = next(i for i, _, d in w.devices.items if d.name == name)
    item.setCheckState(0, Qt.Checked if on else Qt.Unchecked)


@pytest.mark.slow
def test_picks_on_two_hosts_make_one_ddp_run_across_them(ssh_home, sshd, make_window, qtbot, tmp_path):
    add_host_alias(sshd, "hostb")
    a, b = tmp_path / "host-a", tmp_path / "host-b"
    a.mkdir()
    b.mkdir()
    w = make_window()
    line = w.host_picks.line
    pick_host(w, qtbot, "testhost", a)
    assert w.host_picks.widget.isHidden()  # one host: a run there, as before
    click(w, "cpu:1", False)  # testhost: cpu:0 only
    pick_host(w, qtbot, "hostb", b)
    assert [d.name for d in w.devices.selected()] == ["cpu:0", "cpu:1"]  # hostb shows its own list
    assert not w.host_picks.widget.isHidden()
    assert line.text().startswith("One ddp run across testhost (1 device) and hostb (2 devices)")
    assert "strategy ddp" in line.text() and "run folder on testhost" in line.text()
    pick_host(w, qtbot, "testhost", a)  # back: testhost's own picks come back
    assert [d.name for d in w.devices.selected()] == ["cpu:0"]
    assert "testhost (1 device) and hostb (2 devices)" in line.text()
    pick_host(w, qtbot, "hostb", b)
    w.host_picks.clear_others()  # "Only this host": the run goes on hostb alone
    assert w.host_picks.widget.isHidden() and w.host_picks.across() == []
    pick_host(w, qtbot, "testhost", a)  # its picks were forgotten: its list as first shown, both lanes
    assert w.host_picks.across() == [("hostb", "cpu:0,cpu:1"), ("testhost", "cpu:0,cpu:1")]
    click(w, "cpu:1", False)
    assert w.host_picks.across() == [("hostb", "cpu:0,cpu:1"), ("testhost", "cpu:0")]
    assert line.text().startswith("One ddp run across hostb (2 devices) and testhost (1 device)")
    assert "run folder on hostb" in line.text()

    w.form.set_task("linear")
    w.form.editors["train.steps"].widget.setValue(6)
    w.form.editors["train.log_every"].widget.setValue(2)
    w.form.editors["train.eval_every"].widget.setValue(3)
    assert w.validate() == []
    assert w.start()
    qtbot.waitUntil(lambda: not w.is_running(), timeout=600_000)
    assert w.last_result["status"] == "finished", w.last_result
    mirror = Path(w.shown_run_dir)
    info = json.loads((mirror / "remote.json").read_text())
    run = Path(info["path"])
    assert info["host"] == "hostb" and run.parent == b  # the first host picked holds the run folder
    assert [(n["host"], n["devices"]) for n in info["nodes"]] == [("hostb", "cpu:0,cpu:1"), ("testhost", "cpu:0")]
    assert (mirror / "metrics.jsonl").read_bytes() == (run / "metrics.jsonl").read_bytes()
    train = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"train"' in x]
    assert train[-1]["step"] == 6 and len(train[-1]["device_loss"]) == 3  # three ranks on two hosts
    assert json.loads((run / "config.json").read_text())["devices"]["strategy"] == "ddp"
    assert not [p for p in a.iterdir() if not p.name.startswith(".")]  # testhost: no run folder of its own


def test_a_run_across_hosts_starts_nothing_when_one_host_refuses(ssh_home, sshd, qtbot, tmp_path):
    # fast tier (every module): gui/runs/multi_host_follow.py's connect. Every host must answer
    # before anything starts: here the second refuses the key; the first one's connection is closed,
    # no launcher started there, and the window gets one line naming the host that refused.
    from multilane.gui.runs.multi_host_follow import MultiHostFollowWorker

    a, b = tmp_path / "host-a", tmp_path / "host-b"
    a.mkdir()
    b.mkdir()
    sessions = len(sshd.session_processes())
    config = {"task": {"name": "linear"}, "train": {"steps": 4}}
    nodes = [("testhost", "cpu:0", MULTILANE, str(a)), ("wrongkey", "cpu:0", MULTILANE, str(b))]
    worker = MultiHostFollowWorker(nodes, tmp_path / "local", config)
    result = worker._loop()  # what the worker's thread runs first
    assert result["status"] == "rejected" and result["step"] == 0 and result["run_dir"] == ""
    assert "wrongkey" in result["message"] and "authentication failed" in result["message"]
    assert "\n" not in result["message"]
    assert not any(a.iterdir()) and not any(b.iterdir()) and not (tmp_path / "local").exists()
    qtbot.waitUntil(lambda: len(sshd.session_processes()) <= sessions, timeout=10_000)  # testhost's closed
