"""Resuming a run on a host (a real sshd on 127.0.0.1): one still live there is refused in one line
before anything starts there; the host's run folders are listed newest first with state and step."""

from __future__ import annotations

import subprocess
import time

import pytest
from helpers import CLI
from sshd_server import MULTILANE

pytestmark = pytest.mark.timeout(300)


@pytest.mark.slow
def test_train_host_resume_of_a_live_run_is_one_line_and_the_list_marks_it(sshd, ssh_home):
    from multilane.engine.remote.connection import connect
    from multilane.engine.remote.remote_runs import list_runs

    runs = sshd.runs / "cli-live"
    args = ["train", "--task", "linear", "--steps", "10000000", "--runs-dir", str(runs), "--name", "live"]
    done = subprocess.run([*CLI, *args[:3], "--steps", "20", *args[5:]], capture_output=True, timeout=240)
    assert done.returncode == 0, done.stderr
    time.sleep(1.1)  # the next folder is newer by its name's second
    live = subprocess.Popen([*CLI, *args, "--set", "train.checkpoint_every=50"], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while len(list(runs.glob("*/checkpoints/last.pt"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        folder = max(p for p in runs.iterdir() if not p.name.startswith("."))
        before = sorted(p.name for p in folder.iterdir())
        p = subprocess.run(
            [*CLI, "train", "--host", "testhost", "--remote-command", MULTILANE, "--resume", str(folder), "--detach"],
            capture_output=True, text=True, env=sshd.env(), stdin=subprocess.DEVNULL, timeout=120,
        )  # fmt: skip
        assert p.returncode == 2, (p.stdout, p.stderr)
        assert p.stderr.strip() == (
            f"multilane: error: testhost: run {folder} is in use by pid {live.pid} there; one run writes to a "
            "folder at a time (stop it, or follow it with File > Follow run)"
        )
        assert sorted(p.name for p in folder.iterdir()) == before and live.poll() is None

        with connect("testhost", remote_command=MULTILANE) as conn:
            rows = list_runs(conn, str(runs))
        assert [r.path for r in rows] == [str(folder), str(min(runs.iterdir()))]  # newest first
        assert rows[0].live_pid == live.pid and rows[0].state == "running" and rows[0].checkpoint
        assert rows[1].live_pid is None and rows[1].state == "finished" and rows[1].step == 20
    finally:
        live.terminate()
        live.wait(60)


def test_listing_a_runs_folder_that_is_not_there_makes_nothing(sshd, ssh_home):
    from multilane.engine.remote.connection import connect
    from multilane.engine.remote.remote_runs import runs_folder_there

    with connect("testhost", remote_command=MULTILANE) as conn:
        assert runs_folder_there(conn, str(sshd.runs / "not yet")) is None
        assert runs_folder_there(conn, str(sshd.runs)) == str(sshd.runs.resolve())
    assert not (sshd.runs / "not yet").exists()
