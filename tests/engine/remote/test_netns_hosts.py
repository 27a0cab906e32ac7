"""One ddp run across two hosts with their own addresses: two network namespaces made by
the test (tests/netns_hosts.py), a veth pair between them, an sshd in each. The ranks talk over that link
(10.77.0.1 ↔ 10.77.0.2), not over loopback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import CLI
from netns_hosts import ADDRESSES, netns_hosts  # noqa: F401 (the fixture)

pytestmark = [pytest.mark.timeout(400), pytest.mark.xdist_group("node-rank")]

SMALL = ["--task", "linear", "--steps", "6", "--set", "train.log_every=2", "--set", "train.eval_every=3"]


def records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_bytes().splitlines() if x.strip()]


@pytest.mark.slow
def test_two_hosts_with_their_own_addresses_train_one_ddp_run_equal_to_one_hosts(sshd, netns_hosts, tmp_path):  # noqa: F811
    h = netns_hosts
    reach = f"import socket; socket.create_connection(({ADDRESSES[1]!r}, 22), 5)"  # host 0 reaches host 1's sshd
    assert h.ns(0, sys.executable, "-c", reach, check=False).returncode == 0
    local = tmp_path / "local"
    p = subprocess.run(
        [
            *CLI, "train", "--host", f"{h.aliases[0]}=cpu:0,cpu:1", "--host", f"{h.aliases[1]}=cpu:0",
            "--remote-command", h.commands[0], "--remote-runs-dir", str(h.runs[0]), "--remote-runs-dir", str(h.runs[1]),
            "--rdzv-endpoint", f"{ADDRESSES[0]}:29400", "--runs-dir", str(local), *SMALL,
        ],
        capture_output=True, text=True, env=sshd.env(), timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert p.returncode == 0, (p.stdout, p.stderr)
    assert f"rendezvous at {ADDRESSES[0]}:29400" in p.stderr and "finished: step 6/6" in p.stdout
    (mirror,) = local.iterdir()
    remote = json.loads((mirror / "remote.json").read_text())
    run = Path(remote["path"])
    assert run.parent == h.runs[0] and [n["host"] for n in remote["nodes"]] == list(h.aliases)
    assert (mirror / "metrics.jsonl").read_bytes() == (run / "metrics.jsonl").read_bytes()
    train = [r for r in records(run / "metrics.jsonl") if r["kind"] == "train"]
    assert sorted(k.split("/")[1] for k in train[-1]["device_loss"]) == ["rank0", "rank1", "rank2"]
    one = tmp_path / "one"
    q = subprocess.run(
        [*CLI, "train", "--strategy", "ddp", "--devices", "cpu:0,cpu:1,cpu:2", "--runs-dir", str(one), *SMALL],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert q.returncode == 0, q.stderr
    (ref,) = [f for f in one.iterdir() if not f.name.startswith(".")]
    for kind, key in (("train", "loss"), ("eval", "val_loss")):
        got = [(r["step"], r[key]) for r in records(run / "metrics.jsonl") if r["kind"] == kind]
        want = [(r["step"], r[key]) for r in records(ref / "metrics.jsonl") if r["kind"] == kind]
        assert got and len(got) == len(want), (kind, got, want)
        for (s1, x), (s2, y) in zip(got, want, strict=True):
            assert s1 == s2 and abs(x - y) <= 1e-12 * abs(y), (kind, s1, x, y)
    # nothing of the run is left in either namespace: only its sshd (and no session) remains
    for k in (0, 1):
        assert _run_pids(h, k) == [], (k, [_cmdline(pid) for pid in _run_pids(h, k)])


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


LONG = ["--task", "linear", "--steps", "1000000", "--set", "train.log_every=5", "--set", "train.eval_every=0"]


@pytest.mark.slow
def test_a_link_cut_mid_run_stops_every_node_names_the_lost_host_and_resume_carries_on(
    sshd,
    netns_hosts,  # noqa: F811
    tmp_path,
):
    h = netns_hosts
    for runs in h.runs:  # the hosts are the module's: the other test's run folders go first
        for f in runs.iterdir():
            shutil.rmtree(f) if f.is_dir() else f.unlink()
    local = tmp_path / "local"
    args = [
        *CLI, "train", "--host", f"{h.aliases[0]}=cpu:0", "--host", f"{h.aliases[1]}=cpu:0",
        "--remote-command", h.commands[0], "--remote-runs-dir", str(h.runs[0]), "--remote-runs-dir", str(h.runs[1]),
        "--rdzv-endpoint", f"{ADDRESSES[0]}:29401", "--runs-dir", str(local), *LONG,
        "--set", "devices.collective_timeout_s=10", "--set", "train.checkpoint_every=10",
    ]  # fmt: skip
    proc = subprocess.Popen(args, env=sshd.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while _step(h.runs[0]) < 30 or not list(h.runs[0].glob("*/checkpoints/last.pt")):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the run did not reach step 30"
            time.sleep(0.3)
        h.link(1, False)  # host 1 is cut off from host 0 (this computer still reaches both)
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=200)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        h.link(1, True)
    assert proc.returncode == 1, (out, err)
    assert took < 10 + 30, took  # the collective timeout, then the launchers' teardown and the last poll
    (run,) = [f for f in h.runs[0].iterdir() if not f.name.startswith(".")]
    lost = f"; lost node 1 ({h.aliases[1]}, {ADDRESSES[1]}): the link to it or the host itself went down"
    # host 0's launcher records the outcome once its ranks are gone, after waiting a moment for another
    # node's note (engine/distributed/failures.py): the run folder names the host it lost
    deadline = time.monotonic() + 60
    while not (status := json.loads((run / "status.json").read_text()))["message"].endswith(lost):
        assert time.monotonic() < deadline, status
        time.sleep(0.3)
    assert status["state"] == "failed", status
    _nothing_left(h)
    # The link restored: `--resume` carries on across both hosts from host 0's last checkpoint (host 1 holds
    # no copy of the run folder: rank 0's checkpoint reaches its rank) and is followed to its end.
    import torch

    ck_step = torch.load(run / "checkpoints" / "last.pt", weights_only=True)["step"]
    again = [
        *CLI, "train", "--host", f"{h.aliases[0]}=cpu:0", "--host", f"{h.aliases[1]}=cpu:0",
        "--remote-command", h.commands[0], "--remote-runs-dir", str(h.runs[0]), "--remote-runs-dir", str(h.runs[1]),
        "--rdzv-endpoint", f"{ADDRESSES[0]}:29402", "--runs-dir", str(local), "--resume", str(run),
        "--steps", str(ck_step + 10),
    ]  # fmt: skip
    r = subprocess.run(again, env=sshd.env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert f"finished: step {ck_step + 10}/{ck_step + 10}" in r.stdout, r.stdout
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "finished" and status["step"] == ck_step + 10, status
    train = [x for x in records(run / "metrics.jsonl") if x["kind"] == "train" and x["step"] > ck_step]
    assert train[-1]["step"] == ck_step + 10 and sorted(k.split("/")[1] for k in train[-1]["device_loss"]) == [
        "rank0",
        "rank1",
    ]
    assert not [f for f in h.runs[1].iterdir() if not f.name.startswith(".")]  # host 1 made no run folder
    _nothing_left(h)


def _nothing_left(h) -> None:
    for k in (0, 1):  # every node stopped: nothing of the run is left on either host
        deadline = time.monotonic() + 30
        while (left := _run_pids(h, k)) and time.monotonic() < deadline:
            time.sleep(0.3)
        assert left == [], (k, [_cmdline(pid) for pid in left])


def _step(runs: Path) -> int:
    for f in runs.glob("*/status.json"):
        try:
            return json.loads(f.read_text()).get("step") or 0
        except ValueError:
            return 0
    return 0


def _run_pids(h, k: int) -> list[int]:
    return [pid for pid in h.pids(k) if pid != h.procs[k].pid and _name(pid) != "sshd"]
