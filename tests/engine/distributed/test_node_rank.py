"""``--node-rank``: the nodes of a ddp run in a fixed order (torch's static rendezvous), node 0 holding
the store and global rank 0, whatever the order they start in (the c10d rendezvous orders them by host
name, then pid). What a run across hosts (engine/remote/multi_host.py) builds on."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from helpers import CLI

# One xdist group for the tests that start `--node-rank` launchers: some assert that none is left on the machine.
pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("node-rank")]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node(runs: Path, rank: int, endpoint: str, *extra: str, devices: str = "cpu:0") -> list[str]:
    return [
        *CLI, "train", "--strategy", "ddp", "--task", "linear", "--devices", devices, "--runs-dir", str(runs),
        "--steps", "4", "--set", "train.log_every=2", "--nnodes", "2", "--node-rank", str(rank),
        "--rdzv-endpoint", endpoint, *extra,
    ]  # fmt: skip


@pytest.mark.slow
def test_node_0_holds_rank_0_and_the_run_folder_even_when_it_starts_last(tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    a, b = tmp_path / "runs-a", tmp_path / "runs-b"
    # node 1 first: the lower pid, which c10d's rendezvous would make rank 0 on one machine
    one = subprocess.Popen(node(b, 1, endpoint), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    zero = subprocess.Popen(
        node(a, 0, endpoint, devices="cpu:0,cpu:1"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    errs = [p.communicate(timeout=240)[1] for p in (zero, one)]
    assert [zero.returncode, one.returncode] == [0, 0], errs
    (run,) = a.iterdir()
    assert not b.exists()  # node 1 made no folder
    train = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"train"' in x]
    lanes = dict(k.split("/")[1:] for k in train[-1]["device_loss"])  # "<host>/rankN/<device>"
    assert lanes == {"rank0": "cpu:0", "rank1": "cpu:1", "rank2": "cpu:0"}  # node 0's two lanes: ranks 0 and 1
    assert json.loads((run / "status.json").read_text())["state"] == "finished"


@pytest.mark.slow
def test_a_node_rank_out_of_range_and_a_lone_node_0_are_one_line_each(tmp_path):
    r = subprocess.run(node(tmp_path / "runs", 2, "127.0.0.1:1"), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip() == "multilane: error: --node-rank 2: expected 0 to 1 (--nnodes 2)"
    # node 0 alone, in a folder made for it (as a run across hosts makes it): one line, and the folder says why
    folder = tmp_path / "made"
    (folder / "checkpoints").mkdir(parents=True)
    env = {**os.environ, "MULTILANE_RUN_DIR": str(folder)}
    r = subprocess.run(
        node(tmp_path / "runs", 0, f"127.0.0.1:{free_port()}", "--rdzv-timeout", "3"),
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    (line,) = r.stderr.strip().splitlines()
    assert r.returncode == 2 and line.startswith("multilane: error: rendezvous at 127.0.0.1:") and "3 s" in line, line
    status = json.loads((folder / "status.json").read_text())
    assert status["state"] == "failed" and status["message"].startswith("rendezvous at"), status
    assert not (tmp_path / "runs").exists()


def _two_nodes(zero: list[str], one: list[str], endpoint: str) -> None:
    """Node 1 first, then node 0; both must end 0."""
    args = ["--nnodes", "2", "--rdzv-endpoint", endpoint]
    procs = [
        subprocess.Popen([*CLI, "train", *cmd, *args, "--node-rank", str(k)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for k, cmd in ((1, one), (0, zero))
    ]  # fmt: skip
    errs = [p.communicate(timeout=240)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs


@pytest.mark.slow
def test_a_run_across_nodes_resumes_with_a_node_that_has_no_copy_of_the_run_folder(tmp_path):
    """Hosts that share no folder (a run across hosts): node 1 never had the run folder or its checkpoint;
    rank 0's checkpoint reaches every rank, and the resumed run equals a straight run to the last bit."""
    import torch

    common = ["--strategy", "ddp", "--task", "linear", "--devices", "cpu:0", "--set", "train.log_every=1"]
    a, b = tmp_path / "host0-runs", tmp_path / "host1-runs"
    _two_nodes([*common, "--steps", "3", "--runs-dir", str(a)], [*common, "--steps", "3", "--runs-dir", str(b)],
               f"127.0.0.1:{free_port()}")  # fmt: skip
    (run,) = a.iterdir()
    assert not b.exists()
    fresh = tmp_path / "host1-new-runs"  # node 1 of the resume: a host without the run folder
    _two_nodes(["--resume", str(run), "--steps", "6"], [*common, "--steps", "6", "--runs-dir", str(fresh)],
               f"127.0.0.1:{free_port()}")  # fmt: skip
    assert not fresh.exists()
    straight = tmp_path / "straight"
    r = subprocess.run([*CLI, "train", *common, "--devices", "cpu:0,cpu:1", "--steps", "6", "--runs-dir", str(straight)],
                       capture_output=True, text=True, timeout=240)  # fmt: skip
    assert r.returncode == 0, r.stderr
    (ref,) = straight.iterdir()

    def losses(folder: Path) -> dict[int, float]:
        recs = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines() if '"train"' in x]
        return {r["step"]: r["loss"] for r in recs}

    assert losses(run) == losses(ref) and sorted(losses(run)) == [1, 2, 3, 4, 5, 6]
    mine, want = (torch.load(f / "checkpoints" / "last.pt", weights_only=True)["model"] for f in (run, ref))
    assert all(torch.equal(mine[k], want[k]) for k in want)
    assert json.loads((run / "status.json").read_text())["step"] == 6
