"""The FSDP2 noise-scale probe (engine/health/lane_grads.py: ``probe_reduce_scatter``, the engine's ``fsdp_reduce_scatter``)
takes FSDP's reduce-scatter over only where the model's is FSDP's own (or an earlier run's probe): a real ``fully_shard`` on a one-process gloo group, in this process.
The numbers themselves are checked on two processes in test_health_integrations.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from multilane.engine.health.lane_grads import LaneGradProbe
from torch import nn


@pytest.fixture
def group(tmp_path):
    # a file store, as the other in-process groups of one (test_fsdp_options, test_fsdp_health): no TCP
    # store's thread is left in the pytest worker (test_rank_in_process.py says why that matters)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def sharded_mlp() -> nn.Sequential:
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    return model


def comms(model: nn.Module) -> list[str]:
    from torch.distributed.fsdp import FSDPModule

    return [
        type(g._reduce_scatter_comm).__name__
        for m in model.modules()
        if isinstance(m, FSDPModule)
        for g in m._get_fsdp_state()._fsdp_param_groups
    ]


def test_the_probe_replaces_fsdps_own_reduce_scatter_and_leaves_a_users_own(group):
    from multilane.engine.health.lane_grads import fsdp_reduce_scatter, is_sharded, probe_reduce_scatter

    probe = LaneGradProbe(2, torch.device("cpu"), always=True)
    plain = nn.Sequential(nn.Linear(4, 2))
    assert not is_sharded(plain) and probe_reduce_scatter(plain, probe, 0, 2) == "no module is FSDP2's (fully_shard)"
    model = sharded_mlp()
    assert is_sharded(model) and comms(model) == ["DefaultReduceScatter"] * 2  # the root holds no parameter
    assert probe_reduce_scatter(model, probe, 0, 2) is None
    assert comms(model) == ["ProbeReduceScatter"] * 2  # the engine's
    assert probe_reduce_scatter(model, probe, 0, 2) is None  # a second run on the same model: replaced
    model(torch.randn(3, 4)).sum().backward()  # one process: FSDP copies, no reduce-scatter to probe
    assert all(p.grad is not None for p in model.parameters())

    class Mine(type(fsdp_reduce_scatter(probe, 0, 2))):  # a user's own reduce-scatter
        pass

    theirs = sharded_mlp()
    theirs[0].set_custom_reduce_scatter(Mine())
    why = probe_reduce_scatter(theirs, probe, 0, 2)
    assert why == "the model's FSDP already reduce-scatters through its own Mine"
    assert comms(theirs) == ["Mine", "DefaultReduceScatter"]  # nothing replaced
