"""Training on a host: `train --host` detached or followed, the mirror, a cut connection, Stop, Ctrl+C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import CLI
from sshd_server import MULTILANE

pytestmark = pytest.mark.timeout(300)

LONG = ["--task", "linear", "--steps", "1000000", "--set", "train.log_every=5", "--set", "train.eval_every=0"]


def cli(env: dict, *args: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=env, **kw)


def wait_for(predicate, timeout: float = 120.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def state(folder: Path) -> str | None:
    try:
        return json.loads((folder / "status.json").read_text()).get("state")
    except (OSError, ValueError):
        return None


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_bytes().splitlines() if x.strip()]


@pytest.mark.slow
def test_a_detached_run_on_a_host_takes_every_path_as_data_and_trains_on(sshd, tmp_path):
    weird = sshd.runs / 'a b\'c; $(touch PWNED) `touch PWNED2` "q"'
    p = cli(
        sshd.env(),
        "train", "--host", "testhost", "--remote-command", MULTILANE, "--remote-runs-dir", str(weird),
        "--task", "linear", "--steps", "40", "--name", "x;y", "--detach", cwd=tmp_path,
    )  # fmt: skip
    assert p.returncode == 2 and "run.name" in p.stderr  # a name that is not a folder name is refused here
    p = cli(
        sshd.env(),
        "train", "--host", "testhost", "--remote-command", MULTILANE, "--remote-runs-dir", str(weird),
        "--task", "linear", "--steps", "40", "--name", "my-run", "--detach", cwd=tmp_path,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    host, _, remote = p.stdout.strip().partition(":")
    folder = Path(remote)
    assert host == "testhost" and folder.parent == weird and folder.name.endswith("-my-run")
    wait_for(lambda: state(folder) == "finished", what="the detached run to finish")  # trained on after we left
    for root in (tmp_path, sshd.runs, weird, Path.home(), Path("/root")):
        assert not list(root.glob("PWNED*")), root
    assert json.loads((folder / "config.json").read_text())["run"]["runs_dir"] == str(weird)


@pytest.mark.slow
def test_train_on_a_host_mirrors_the_run_folder_byte_for_byte(sshd, tmp_path):
    local = tmp_path / "local-runs"
    p = cli(
        sshd.env(),
        "train", "--host", "testhost", "--remote-command", MULTILANE, "--remote-runs-dir", str(sshd.runs),
        "--runs-dir", str(local), "--task", "linear", "--steps", "60", "--set", "train.log_every=2",
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "finished: step 60/60" in p.stdout
    (mirror,) = local.iterdir()
    remote = json.loads((mirror / "remote.json").read_text())
    assert remote["host"] == "testhost" and mirror.name == Path(remote["path"]).name + "@testhost"
    assert (mirror / "metrics.jsonl").read_bytes() == (Path(remote["path"]) / "metrics.jsonl").read_bytes()
    assert json.loads((mirror / "status.json").read_text())["state"] == "finished"
    assert not (mirror / "checkpoints").exists()  # checkpoints stay on the host
    # the mirror is a run folder: export works on it offline
    out = cli(sshd.env(), "export", str(mirror), "--out", str(tmp_path / "fig"), "--format", "csv")
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "fig" / "metrics.csv").read_text().count("\n") > 30
    # and `watch HOST:RUN_DIR` follows the same run into the same mirror, adding nothing twice
    w = cli(sshd.env(), "watch", f"testhost:{remote['path']}", "--runs-dir", str(local), "--remote-command", MULTILANE)
    assert w.returncode == 0, w.stderr
    assert "finished: step 60/60" in w.stdout
    assert (mirror / "metrics.jsonl").read_bytes() == (Path(remote["path"]) / "metrics.jsonl").read_bytes()


@pytest.mark.slow
def test_a_cut_connection_resumes_at_its_offset_and_stop_reaches_the_host(sshd, ssh_home, tmp_path):
    from multilane.engine.config import build_config
    from multilane.engine.remote.connection import connect
    from multilane.engine.remote.launch import launch_run
    from multilane.engine.remote.mirror import RemoteFollower, RemoteMirror, mirror_folder

    conn = connect("testhost", remote_command=MULTILANE)
    config = build_config({"task": {"name": "linear"}, "train": {"steps": 1_000_000, "log_every": 5, "eval_every": 0}})
    run = launch_run(conn, config.to_dict(), str(sshd.runs))
    remote = Path(run.path)
    follower = RemoteFollower(RemoteMirror(conn, run.path, mirror_folder(tmp_path, "testhost", run.path), run))
    steps: list[int] = []

    def poll() -> None:
        steps.extend(r["step"] for r in follower.poll().records if r.get("kind") == "train")

    try:
        wait_for(lambda: poll() or len(steps) >= 5, what="the first records")
        sshd.stop()  # sshd and its session processes gone: the connection is cut, and stays cut
        try:
            size = (remote / "metrics.jsonl").stat().st_size
            poll()
            assert follower.reconnecting and "reconnecting to testhost" in follower.reconnecting
            wait_for(lambda: (remote / "metrics.jsonl").stat().st_size > size + 2000, what="records while cut off")
            poll()
            assert follower.reconnecting
        finally:
            sshd.start()
        wait_for(lambda: poll() or (follower.reconnecting is None and len(steps) > 20), what="the reconnection")
        follower.control("stop")
        wait_for(lambda: poll() or follower.done, what="the stop")
    finally:
        if not follower.done:
            os.kill(run.pid, signal.SIGTERM)
        conn.close()
    assert follower.status["state"] == "stopped" and follower.lost is None
    assert (follower.run_dir / "metrics.jsonl").read_bytes() == (remote / "metrics.jsonl").read_bytes()
    # every record once, in order: no gap, no duplicate (the last one closes the window the stop cut short)
    assert steps[:-1] == list(range(5, 5 * len(steps), 5)) and steps[-2] < steps[-1] <= steps[-2] + 5


@pytest.mark.slow
def test_ctrl_c_stops_the_run_on_the_host(sshd, tmp_path):
    local = tmp_path / "local-runs"
    args = ["train", "--host", "testhost", "--remote-command", MULTILANE, "--remote-runs-dir", str(sshd.runs)]
    proc = subprocess.Popen(
        [*CLI, *args, "--runs-dir", str(local), *LONG],
        env=sshd.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: any((m / "metrics.jsonl").exists() for m in local.glob("*")), what="the mirror")
        (mirror,) = local.iterdir()
        wait_for(lambda: (mirror / "metrics.jsonl").stat().st_size > 500, what="records in the mirror")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "stop requested on testhost" in out
    remote = Path(json.loads((mirror / "remote.json").read_text())["path"])
    assert state(remote) == "stopped" and state(mirror) == "stopped"
    assert (mirror / "metrics.jsonl").read_bytes() == (remote / "metrics.jsonl").read_bytes()


def test_a_status_rewritten_in_the_same_second_at_the_same_size_reaches_the_mirror(sshd, ssh_home, tmp_path):
    # SFTP's mtimes are whole seconds: "running" at step 0 then "finished" at step 6, the same size and
    # the same second, once kept the mirror "running" for ever (a multi-host GUI run read as failed).
    from multilane.engine.remote.connection import connect
    from multilane.engine.remote.mirror import RemoteMirror

    remote = sshd.runs / "same-second"
    remote.mkdir(parents=True)
    first, last = b'{"state": "running", "step": 10}\n', b'{"state": "finished", "step": 9}\n'
    assert len(first) == len(last)
    (remote / "status.json").write_bytes(first)
    os.utime(remote / "status.json", (1_800_000_000.2, 1_800_000_000.2))
    with connect("testhost", remote_command=MULTILANE) as conn:
        mirror = RemoteMirror(conn, str(remote), tmp_path / "mirror")
        mirror.sync()
        assert (tmp_path / "mirror" / "status.json").read_bytes() == first
        (remote / "status.json").write_bytes(last)
        os.utime(remote / "status.json", (1_800_000_000.7, 1_800_000_000.7))  # the same whole second
        mirror.sync()
        assert (tmp_path / "mirror" / "status.json").read_bytes() == last
        assert not mirror.sync()  # nothing new: no copy, nothing reported
