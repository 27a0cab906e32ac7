"""fsdp's options, activation checkpointing and CPU offload (``devices.fsdp_*``).

- In one process (a one-rank Gloo group): the units the rule picks are recomputed in backward, except
  one holding BatchNorm; CPU offload is torch's ``CPUOffloadPolicy``, unpinned on CPU lanes (pinning
  needs an accelerator); the gradients equal an unsharded copy's.
- Real ranks (the ddp launcher, float64, the charlm transformer on 2 ranks, its 6 units): with each
  option on, and both, 3 steps equal one device's full-batch training to 1e-10
  (``fsdp_helpers.assert_equal_runs``: every loss, gradient norm, validation loss, parameter); the runs
  with activation checkpointing resume at step 2 from their own sharded checkpoint with the options off.
- Either option under another strategy is refused in one line.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from fsdp_helpers import assert_equal_runs, launch, resume, run_dirs, settings, single_process
from multilane.engine.config import build_config
from multilane.engine.errors import UserError
from multilane.engine.fsdp.units import default_units, shard_model
from torch import nn

AC, OFFLOAD = "fsdp_activation_checkpointing", "fsdp_cpu_offload"


def test_units_are_recomputed_in_backward_and_offloaded_and_the_gradients_are_exact(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.GELU(), nn.Linear(4, 4), nn.BatchNorm1d(4)).double()
    plain = copy.deepcopy(model)
    x = torch.randn(6, 3, dtype=torch.float64)
    plain(x).pow(2).sum().backward()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        units = default_units(model)
        shard_model(model, units, "fp32", activation_checkpointing=True, cpu_offload=True)
        calls = {i: 0 for i in ("0", "2", "3")}
        for name in calls:  # a pre-hook: the recompute stops once it has what backward needs (early_stop)
            model.get_submodule(name).register_forward_pre_hook(lambda *a, n=name: calls.__setitem__(n, calls[n] + 1))
        model(x).pow(2).sum().backward()
        assert calls == {"0": 2, "2": 2, "3": 1}  # BatchNorm's unit is not recomputed
        group = model[0]._get_fsdp_state()._fsdp_param_group
        policy = group.offload_policy
        assert type(policy).__name__ == "CPUOffloadPolicy" and policy.pin_memory is False
        assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
        for (n, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
            assert torch.equal(p.grad.full_tensor(), q.grad), n
    finally:
        dist.destroy_process_group()


def test_the_options_are_refused_under_another_strategy_in_one_line():
    for option in (AC, OFFLOAD):
        with pytest.raises(UserError) as e:
            build_config({"devices": {"strategy": "ddp", option: True}})
        assert str(e.value) == (
            f"config: devices.{option} = true: an fsdp option, and strategy = ddp: use strategy fsdp, "
            f"or set it false (--set devices.{option}=false)"
        )
    assert build_config({"devices": {"strategy": "fsdp", AC: True, OFFLOAD: True}}).devices.fsdp_cpu_offload


CASES = {  # the options of steps 1-2; the options of step 3 when the run resumes at step 2 (or None)
    "activation checkpointing, resumed without": ({AC: True}, {AC: False}),
    "CPU offload": ({OFFLOAD: True}, None),
    "both, resumed with neither": ({AC: True, OFFLOAD: True}, {AC: False, OFFLOAD: False}),
}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", list(CASES))
def test_fsdp_with_its_options_equals_one_device_full_batch_training(tmp_path, case):
    on, then = CASES[case]
    launch(tmp_path, settings("charlm", 3 if then is None else 2, "cpu:0,cpu:1", **on))
    (run,) = run_dirs(tmp_path / "runs")
    if then is not None:
        sets = [a for o, v in then.items() for a in ("--set", f"devices.{o}={str(v).lower()}")]
        resume(run, "--steps", "3", *sets)
    state, records, _ = single_process(tmp_path, settings("charlm", 3, "cpu:0"), "one")
    assert_equal_runs(run, state, records, case)
