"""fsdp across two nodes: two launchers with `--nnodes 2 --node-rank K` (torch's static
rendezvous on 127.0.0.1, the same launcher as ddp across hosts), one rank each, sharing one runs folder
as nodes on a shared filesystem do: each rank writes its own shards of one sharded checkpoint into the
run folder, and the run equals one device's full-batch training to 1e-10 (float64), as on one node."""

from __future__ import annotations

import json
import socket
import subprocess

import pytest
from fsdp_helpers import assert_equal_runs, run_dirs, settings, single_process
from helpers import CLI

pytestmark = [pytest.mark.timeout(600), pytest.mark.xdist_group("node-rank")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_fsdp_across_two_nodes_on_a_shared_folder_equals_one_device(tmp_path):
    cfg = settings("mlp", 3, "cpu:0")
    runs = tmp_path / "shared-runs"
    path = tmp_path / "launch.json"
    path.write_text(json.dumps({**cfg, "run": {"runs_dir": str(runs), "name": "fsdp"}}))
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [
        subprocess.Popen([*CLI, "train", "--config", str(path), "--nnodes", "2", "--node-rank", str(k),
                          "--rdzv-endpoint", endpoint], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for k in (1, 0)
    ]  # fmt: skip
    errs = [p.communicate(timeout=300)[1] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], errs
    (run,) = run_dirs(runs)  # one run folder, made by node 0's rank 0
    (sharded,) = (run / "checkpoints").glob("sharded-*")
    assert sorted(p.name for p in sharded.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]  # a shard per node
    state, records, _ = single_process(tmp_path, cfg, "one")
    assert_equal_runs(run, state, records, "fsdp on two nodes")
    last = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"train"' in x][-1]
    assert sorted(k.split("/")[1] for k in last["device_loss"]) == ["rank0", "rank1"]
