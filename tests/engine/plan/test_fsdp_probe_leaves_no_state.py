"""The fsdp forecast's probe runs as rank 0 of a fake process group in the launcher, and the ranks' server
is forked from the launcher afterwards: nothing of the probe may reach a rank. torch's DTensor caches
specs by mesh, and a mesh's equality ignores the rank, so a rank 1 forked after the probe used to shard
its parameters with rank 0's offsets (every sharded checkpoint then failed: DCP's "invalid fill")."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from helpers import TASK_FILES
from multilane.engine.config import build_config
from multilane.engine.distributed.worker import probe_loop
from multilane.engine.plan.fit import plan_run
from multilane.engine.tasks import make_task
from multilane.engine.telemetry.devices import parse_devices
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

TASK = str(TASK_FILES / "conformance_kinds.py")


@pytest.mark.slow
def test_a_rank_sharding_after_the_fsdp_probe_in_its_process_holds_its_own_shards():
    cfg = build_config(
        {
            "task": {"name": TASK, "params": {"kind": "mlp"}},
            "data": {"batch_size": 8, "val_fraction": 0.0},
            "devices": {"use": "cpu:0,cpu:1", "strategy": "fsdp"},
        }
    )
    task = make_task(TASK, {"kind": "mlp"})
    plan_run(cfg, task, parse_devices("cpu:0,cpu:1"), probe_loop)  # the launcher's probe: rank 0 of a fake group of 2
    dist.init_process_group("fake", rank=1, world_size=2)  # now a rank 1 in the same process, as a fork is
    try:
        model = task.build_model()
        for unit in (model[0], model[2], model):
            fully_shard(unit, mesh=init_device_mesh("cpu", (2,)))
        # Each parameter's mesh says where this rank's shard lies (DCP writes it at that offset).
        assert {p.device_mesh.get_coordinate()[0] for p in model.parameters()} == {1}
    finally:
        dist.destroy_process_group()
