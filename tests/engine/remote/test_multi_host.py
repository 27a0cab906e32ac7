"""One ddp run across two hosts: two ssh config aliases of the real sshd on 127.0.0.1,
each with its own runs folder, stand in for two machines. A launcher on each, the rendezvous on the
first, host 0's run folder mirrored; Stop reaches every node; a host that fails leaves nothing behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from helpers import CLI
from sshd_server import MULTILANE, add_host_alias

# One xdist group for the tests that start `--node-rank` launchers: some assert that none is left on the machine.
pytestmark = [pytest.mark.timeout(400), pytest.mark.xdist_group("node-rank")]

SMALL = ["--task", "linear", "--steps", "6", "--set", "train.log_every=2", "--set", "train.eval_every=3"]
LONG = ["--task", "linear", "--steps", "1000000", "--set", "train.log_every=5", "--set", "train.eval_every=0"]


@pytest.fixture(scope="module")
def two_hosts(sshd):
    """``testhost`` and ``hostb``: the same sshd, two names, two runs folders; ``deadhost``: no answer."""
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    add_host_alias(sshd, "hostb")
    cfg = sshd.home / ".ssh" / "config"
    cfg.write_text(cfg.read_text() + f"\nHost deadhost\n  HostName 127.0.0.1\n  Port {dead}\n  ConnectTimeout 3\n")
    a, b = sshd.runs / "host-a", sshd.runs / "host-b"
    a.mkdir()
    b.mkdir()
    return a, b


def cli(env: dict, *args: str, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=env, **kw)


def across(a: Path, b: Path, local: Path, host_b: str = "hostb=cpu:0") -> list[str]:
    return [
        "train", "--host", "testhost=cpu:0,cpu:1", "--host", host_b, "--remote-command", MULTILANE,
        "--remote-runs-dir", str(a), "--remote-runs-dir", str(b), "--runs-dir", str(local),
    ]  # fmt: skip


def records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_bytes().splitlines() if x.strip()]


def run_folders(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def processes_of(rdzv_id: str) -> list[psutil.Process]:
    """Every process of the run on "either host" (both are this machine): launchers and ranks."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        if rdzv_id in " ".join(p.info["cmdline"] or []):
            out.append(p)
    return out


def node_launchers(since: float = 0.0) -> list[psutil.Process]:
    """Every ``--node-rank`` launcher (and rank) on the machine started at ``since`` or later: this test's
    own (this module's tests share one xdist group with the other tests that start them; one test's
    launchers may still be ending, after its run has, when the next test begins)."""
    out = []
    for q in psutil.process_iter(["cmdline", "create_time"]):
        if "--node-rank" in " ".join(q.info["cmdline"] or []) and (q.info["create_time"] or 0) >= since:
            out.append(q)
    return out


def wait_gone(alive, seconds: float) -> list[psutil.Process]:
    """What ``alive()`` still lists after up to ``seconds`` (at once when it lists nothing): a process on
    its way out (an earlier test's launcher tearing down its store on a loaded machine) is given that
    long to go; one left running is still there."""
    end = time.monotonic() + seconds
    while (left := alive()) and time.monotonic() < end:
        time.sleep(0.2)
    return [_Named(q) for q in left]


class _Named:
    """A process as an assertion shows it: its pid, parent, start time and command line."""

    def __init__(self, q: psutil.Process) -> None:
        self.q = q

    def __repr__(self) -> str:
        try:
            q, pid = self.q, self.q.pid
            where = f"pgid {os.getpgid(pid)} sid {os.getsid(pid)} {q.status()}"  # which kill could reach it
            return f"<pid {pid} ppid {q.ppid()} {where} started {q.create_time():.1f}: {' '.join(q.cmdline())[:300]}>"
        except (psutil.Error, OSError):
            return f"<pid {self.q.pid}: gone>"


def rdzv_id_of(node_folder: Path) -> str:
    return node_folder.name.rsplit("-node", 1)[0]


@pytest.mark.slow
def test_two_hosts_train_one_ddp_run_equal_to_the_same_run_on_one_host(sshd, two_hosts, tmp_path):
    a, b = two_hosts
    local = tmp_path / "local"
    p = cli(sshd.env(), *across(a, b, local), *SMALL, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "one ddp run across testhost (2 devices) and hostb (1 device)" in p.stderr
    assert "finished: step 6/6" in p.stdout
    (mirror,) = local.iterdir()
    remote = json.loads((mirror / "remote.json").read_text())
    run = Path(remote["path"])
    assert run.parent == a and mirror.name == f"{run.name}@testhost"
    assert (mirror / "metrics.jsonl").read_bytes() == (run / "metrics.jsonl").read_bytes()
    assert [n["host"] for n in remote["nodes"]] == ["testhost", "hostb"]
    # host B holds no run folder: its launcher's config and console are in a hidden node folder
    assert run_folders(b) == [] and run_folders(a) == [run]
    (node_b,) = (b / ".multilane-nodes").iterdir()
    assert not (node_b / "metrics.jsonl").exists() and not (node_b / "checkpoints").exists()
    train = [r for r in records(run / "metrics.jsonl") if r["kind"] == "train"]
    assert sorted(k.split("/")[1] for k in train[-1]["device_loss"]) == ["rank0", "rank1", "rank2"]
    # exactness across hosts: the same three ranks on one host give the same numbers
    one = tmp_path / "one"
    q = cli(sshd.env(), "train", "--strategy", "ddp", "--devices", "cpu:0,cpu:1,cpu:2", "--runs-dir", str(one), *SMALL)
    assert q.returncode == 0, q.stderr
    (ref,) = run_folders(one)
    ref_records = records(ref / "metrics.jsonl")
    for kind, key in (("train", "loss"), ("eval", "val_loss")):
        got = [(r["step"], r[key]) for r in records(run / "metrics.jsonl") if r["kind"] == kind]
        want = [(r["step"], r[key]) for r in ref_records if r["kind"] == kind]
        assert got and len(got) == len(want), (kind, got, want)
        for (s1, x), (s2, y) in zip(got, want, strict=True):
            assert s1 == s2 and abs(x - y) <= 1e-12 * abs(y), (kind, s1, x, y)
    assert not processes_of(rdzv_id_of(node_b))


@pytest.mark.slow
def test_ctrl_c_stops_every_node_through_the_control_file_on_the_first_host(sshd, two_hosts, tmp_path):
    a, b = two_hosts
    local = tmp_path / "local"
    proc = subprocess.Popen(
        [*CLI, *across(a, b, local, "hostb"), "--devices", "cpu:0", *LONG],
        env=sshd.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    from test_remote_run import wait_for

    try:
        wait_for(lambda: any((m / "metrics.jsonl").exists() for m in local.glob("*")), 200, "the mirror")
        (mirror,) = local.iterdir()
        wait_for(lambda: (mirror / "metrics.jsonl").stat().st_size > 1500, 200, "records in the mirror")
        nodes = json.loads((mirror / "remote.json").read_text())["nodes"]
        rdzv = rdzv_id_of(Path(nodes[1]["path"]))
        running = processes_of(rdzv)
        assert len(running) >= 4  # two launchers and their ranks
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=200)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "stop requested on testhost" in out
    run = Path(nodes[0]["path"])
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "stopped" and json.loads((mirror / "status.json").read_text())["state"] == "stopped"
    _, alive = psutil.wait_procs(running, timeout=60)  # every launcher and rank, on both hosts
    assert not alive and not processes_of(rdzv), [p.pid for p in alive]
    assert all(not psutil.pid_exists(n["pid"]) or psutil.Process(n["pid"]).status() == "zombie" for n in nodes)
    ck = run / "checkpoints" / "last.pt"
    assert ck.is_file()


@pytest.mark.slow
def test_a_second_host_that_does_not_answer_is_one_line_and_nothing_starts(sshd, two_hosts, tmp_path):
    a, b = two_hosts
    before = run_folders(a)
    started = time.time() - 1.0  # create_time has a tick's resolution
    p = cli(sshd.env(), *across(a, b, tmp_path / "local", "deadhost=cpu:0"), *SMALL, timeout=120)
    assert p.returncode == 2
    (line,) = p.stderr.strip().splitlines()
    assert line.startswith("multilane: error: deadhost") and "cannot connect" in line, line
    assert run_folders(a) == before and not (tmp_path / "local").exists()
    assert wait_gone(lambda: node_launchers(started), 20) == []


@pytest.mark.slow
def test_a_node_that_dies_at_start_fails_the_run_at_the_rendezvous_timeout_leaving_nothing(sshd, two_hosts, tmp_path):
    a, b = two_hosts
    local = tmp_path / "local"
    # hostb's launcher exits at once (no such device there): the first host's waits for the rendezvous
    p = cli(sshd.env(), *across(a, b, local, "hostb=cuda:7"), *SMALL, "--rdzv-timeout", "8", timeout=200)
    assert p.returncode != 0
    (mirror,) = local.iterdir()
    status = json.loads((mirror / "status.json").read_text())
    assert status["state"] == "failed" and "rendezvous" in status["message"], status
    assert "failed" in p.stdout + p.stderr
    rdzv = json.loads((mirror / "remote.json").read_text())["nodes"][1]["path"]
    # The first host's launcher wrote "failed" and is on its way out (its store, its notes): gone within
    # seconds of the command's end, never left running (seen alive at the very instant on a loaded machine).
    assert wait_gone(lambda: processes_of(rdzv_id_of(Path(rdzv))), 20) == []


@pytest.mark.slow
def test_bad_host_lists_are_one_line(sshd, two_hosts, tmp_path):
    a, b = two_hosts
    before = run_folders(a), run_folders(b)
    cases = [
        (["--host", "testhost=cpu:0", "--host", "testhost=cpu:1"], "named twice"),
        (["--host", "testhost=", "--host", "hostb=cpu:0"], "no devices after '='"),
        (["--host", "testhost=cpu:0", "--host", "hostb=cpu:0", "--strategy", "replicate"], "cannot span hosts"),
        (["--host", "testhost=cpu:0", "--host", "hostb", "--remote-runs-dir", "x", "--remote-runs-dir", "y",
          "--remote-runs-dir", "z"], "3 times for 2 hosts"),
        (["--host", "testhost=cpu:0", "--host", "hostb=cpu:0", "--nnodes", "3"], "the hosts are the nodes"),
        # --resume across hosts: a folder that is not there, and one that is no run with a checkpoint
        (["--host", "testhost=cpu:0", "--host", "hostb=cpu:0", "--resume", str(tmp_path / "nosuch")],
         "is not a folder there (the first --host)"),
        (["--host", "testhost=cpu:0", "--host", "hostb=cpu:0", "--resume", str(tmp_path)],
         "is not a run with a checkpoint there"),
    ]  # fmt: skip
    for args, words in cases:
        p = cli(sshd.env(), "train", *args, "--remote-command", MULTILANE, *SMALL, timeout=120)
        assert p.returncode == 2, (args, p.stderr)
        (line,) = p.stderr.strip().splitlines()
        assert line.startswith("multilane: error:") and words in line, (args, line)
    assert (run_folders(a), run_folders(b)) == before  # no run folder appears for a refused list


@pytest.mark.slow
def test_a_launcher_that_cannot_start_on_the_second_host_kills_the_first_and_removes_its_folder(
    sshd, two_hosts, tmp_path
):
    a, _ = two_hosts
    b = tmp_path / "runs-b"
    b.mkdir()
    (b / ".multilane-nodes").write_text("a file where host b's node folders would go")
    before = run_folders(a)
    started = time.time() - 1.0
    p = cli(sshd.env(), *across(a, b, tmp_path / "local"), *LONG, timeout=120)
    assert p.returncode == 2, p.stderr
    (line,) = p.stderr.strip().splitlines()
    assert line.startswith("multilane: error: hostb: cannot make") and ".multilane-nodes" in line, line
    assert run_folders(a) == before  # the first host's folder, made for a run that never began, is gone
    # this test's own launchers (their --config is in host a's runs folder): a launcher the previous test of
    # this worker left ending (a netns host's, seen at the start of a CI rehearsal) is not this test's
    left = wait_gone(lambda: [q for q in node_launchers(started) if str(a) in " ".join(q.info["cmdline"] or [])], 20)
    assert left == [], f"{left} (test started at {started + 1.0:.1f})"  # all of them, not the diff's first


def test_a_first_host_known_by_a_loopback_name_is_refused_as_the_rendezvous_of_other_machines(sshd, ssh_home):
    from multilane.engine.errors import UserError
    from multilane.engine.remote.connection import Connection
    from multilane.engine.remote.multi_host import Node, rendezvous_address

    add_host_alias(sshd, "hostb")
    cfg = ssh_home / ".ssh" / "config"
    cfg.write_text(cfg.read_text() + "\nHost farhost\n  HostName 192.0.2.7\n")  # resolved, never connected to
    here, far, also_here = Connection("testhost"), Connection("farhost"), Connection("hostb")
    assert rendezvous_address([Node(here, "cpu:0"), Node(also_here, "cpu:0")]) == "127.0.0.1"  # one machine
    assert rendezvous_address([Node(far, "cpu:0"), Node(here, "cpu:0")]) == "192.0.2.7"
    with pytest.raises(UserError, match=r"127\.0\.0\.1.*loopback.*--rdzv-endpoint ADDR"):
        rendezvous_address([Node(here, "cpu:0"), Node(far, "cpu:0")])
    assert rendezvous_address([Node(here, "cpu:0"), Node(far, "cpu:0")], "10.0.0.5") == "10.0.0.5"  # the override
