"""Each device's memory split into parameters, gradients, optimizer state and the
rest, in the train records and the end-of-run summary, for the single-process strategies (ddp and
fsdp: tests/engine/fsdp/test_fsdp_exact.py)."""

from __future__ import annotations

import pytest
from multilane.engine.display.progress import summary
from multilane.engine.run.trainer import Trainer
from multilane.engine.rundir.runlog import read_metrics
from multilane.engine.telemetry.memory_split import fmt_bytes, split, summary_lines, tensor_bytes
from torch import nn


def test_tied_parameters_count_once_and_adams_state_is_twice_the_parameters():
    import torch

    m = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    m[1].weight = m[0].weight
    assert tensor_bytes(m.parameters()) == tensor_bytes([m[0].weight]) == 10 * 4 * 4
    opt = torch.optim.Adam(m.parameters())
    m(torch.tensor([1, 2])).sum().backward()
    opt.step()
    assert split(list(m.parameters()), opt) == {"params": 160, "grads": 160, "optimizer": 320}


def test_a_sparse_gradient_and_a_parameter_without_one_are_counted_not_failed():
    # Embedding(sparse=True): no storage (data_ptr() raises), its bytes are its indices and values;
    # torch's SGD keeps a sparse momentum buffer for it; a layer no sample reached has no gradient.
    import torch

    m = nn.ModuleDict({"emb": nn.Embedding(10, 4, sparse=True), "never": nn.Linear(4, 4)})
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    m["emb"](torch.tensor([1, 2, 1])).sum().backward()
    opt.step()
    grad = m["emb"].weight.grad
    assert grad.is_sparse and m["never"].weight.grad is None
    parts = split(list(m.parameters()), opt)
    assert parts["params"] == (10 * 4 + 4 * 4 + 4) * 4
    assert parts["grads"] == grad._indices().nbytes + grad._values().nbytes
    assert parts["optimizer"] == tensor_bytes(opt.state[m["emb"].weight].values()) > 0


def test_shards_offloaded_by_fsdp_are_said_to_be_in_host_memory():
    mem = {"r0": {"params": 1 << 20, "grads": 1 << 20, "optimizer": 2 << 20, "rest": 3 << 20, "host": True}}
    assert summary_lines(mem) == [
        "  memory r0: params 1.0 MiB · grads 1.0 MiB · optimizer 2.0 MiB (in host memory) · rest 3.0 MiB"
    ]


@pytest.mark.parametrize("strategy", ["replicate", "persistent"])
def test_each_lane_of_a_single_process_run_reports_what_it_holds(make_config, strategy):
    cfg = make_config(task__name="mlp", task__params={"samples": 64, "width": 32, "depth": 1}, train__steps=2)
    cfg = cfg.model_copy(update={"devices": cfg.devices.model_copy(update={"strategy": strategy})})
    cfg.telemetry.enabled = False
    trainer = Trainer(cfg)
    result = trainer.run()
    assert result.status == "finished", result.message
    params = tensor_bytes(trainer.model.parameters())
    mem = [r for r in read_metrics(result.run_dir) if r["kind"] == "train"][-1]["memory"]
    lane0, lane1 = mem.values()
    assert lane0 == {"params": params, "grads": params, "optimizer": 2 * params, "rest": None}  # Adam: 2 moments
    # what lane 1 holds at its peak: its replica's parameters, kept by persistent, broadcast to it by
    # replicate every step (and said so); no optimizer state
    assert lane1["params"] == params and lane1["optimizer"] == 0
    assert lane1.get("replica") is (True if strategy == "replicate" else None)
    text = summary(result)
    assert f"memory {next(iter(mem))}: params " in text and "optimizer " in text
    during = f"memory {list(mem)[1]}: params {fmt_bytes(params)} (a replica, during each step)"
    assert (during in text) is (strategy == "replicate"), text
