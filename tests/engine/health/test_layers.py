"""Per-layer health, sampled, against a plain float64 loop on one device.

Every ``health.every`` steps a ``health`` record holds, per layer, the gradient norm of the batch's
gradient, the weight norm and ``‖Δw‖/‖w‖`` of that step, and per chosen activation the mean, std and
fraction of exact zeros over the whole batch (every lane's shard); a deep model's rows are grouped
while ``health_layers.jsonl`` keeps every layer; the readers accept the records and refuse broken ones.
"""

from __future__ import annotations

import json

import pytest
import torch
from multilane.engine.run.trainer import Trainer, TrainerCallback
from multilane.engine.rundir.records import parse_record
from multilane.engine.tasks import ArrayData, Task
from torch import nn

F64 = torch.float64


class Small(Task):
    name = "small"

    def build_model(self):
        return nn.Sequential(
            nn.Linear(5, 8, dtype=F64), nn.ReLU(), nn.Linear(8, 8, dtype=F64), nn.Tanh(), nn.Linear(8, 3, dtype=F64)
        )

    def data(self):
        g = torch.Generator().manual_seed(5)
        return ArrayData(torch.randn(96, 5, generator=g, dtype=F64), torch.randn(96, 3, generator=g, dtype=F64)), None

    def loss(self, output, target):
        return nn.functional.mse_loss(output, target)


class Health(TrainerCallback):
    def __init__(self) -> None:
        self.records: list[dict] = []

    def on_health(self, record: dict) -> None:
        self.records.append(record)


def reference(cfg, task) -> list[dict]:
    """The plain loop: one device, the run's batches, every value computed by hand."""
    ref = Trainer(cfg, task=task)
    ref._setup()
    ref.backend.close()
    model = ref.model
    opt = torch.optim.SGD(model.parameters(), lr=cfg.optim.lr, momentum=cfg.optim.momentum)
    layers = [m for m in model if list(m.parameters())]
    out = []
    for m in range(cfg.train.steps):
        x, y, _ = ref.loader.batches.get(m)
        acts: list[torch.Tensor] = []
        keep = acts.append
        hooks = [k.register_forward_hook(lambda _m, _a, o, keep=keep: keep(o.detach())) for k in (model[1], model[3])]
        loss = task.loss(model(x), y)
        for h in hooks:
            h.remove()
        opt.zero_grad()
        loss.backward()
        before = [torch.cat([p.detach().reshape(-1).clone() for p in k.parameters()]) for k in layers]
        grads = [torch.cat([p.grad.reshape(-1) for p in k.parameters()]).norm().item() for k in layers]
        opt.step()
        after = [torch.cat([p.detach().reshape(-1) for p in k.parameters()]) for k in layers]
        out.append(
            {
                "grad_norm": grads,
                "weight_norm": [w.norm().item() for w in after],
                "update_ratio": [((w - b).norm() / w.norm()).item() for w, b in zip(after, before, strict=True)],
                "act_mean": [a.mean().item() for a in acts],
                "act_std": [a.std(unbiased=False).item() for a in acts],
                "act_zero": [(a == 0).double().mean().item() for a in acts],
            }
        )
    return out


@pytest.mark.parametrize(
    ("devices", "strategy", "weights"),
    [("cpu:0", "replicate", None), ("cpu:0,cpu:1", "replicate", None), ("cpu:0,cpu:1,cpu:2", "persistent", [3, 1, 2])],
)
def test_per_layer_health_equals_a_plain_loop(make_config, devices, strategy, weights):
    task = Small()
    cfg = make_config(
        devices__use=devices,
        devices__strategy=strategy,
        devices__weights=weights or [],
        train__steps=3,
        data__batch_size=24,
        optim__name="sgd",
        optim__lr=0.1,
        optim__momentum=0.9,
        health__every=1,
        health__activations="ReLU, Tanh",
    )
    expect = reference(cfg, task)
    health = Health()
    trainer = Trainer(cfg, callbacks=[health], task=task)
    assert trainer.run().status == "finished"
    assert [r["step"] for r in health.records] == [1, 2, 3]
    for rec, ref in zip(health.records, expect, strict=True):
        assert rec["rows"] == ["0", "2", "4"]
        if strategy == "persistent" and rec["step"] == 1:  # its replicas are made during step 1's forward
            assert "act_rows" not in rec
            ref = {k: v for k, v in ref.items() if not k.startswith("act_")}
        else:
            assert rec["act_rows"] == ["1 (ReLU)", "3 (Tanh)"]
        for key, values in ref.items():
            assert rec[key] == pytest.approx(values, rel=1e-3, abs=1e-12), key
    # the run folder: grouped rows in metrics.jsonl (readers accept them), every layer beside it
    lines = (trainer.run_dir.path / "metrics.jsonl").read_bytes().splitlines()
    on_disk = [parse_record(line) for line in lines if b'"health"' in line]
    assert [r["step"] for r in on_disk] == [1, 2, 3] and all("layers" not in r for r in on_disk)
    full = [json.loads(x) for x in (trainer.run_dir.path / "health_layers.jsonl").read_text().splitlines()]
    assert [f["step"] for f in full] == [1, 2, 3] and full[0]["names"] == ["0", "2", "4"]


class Deep(Small):
    def build_model(self):
        blocks = [nn.Sequential(nn.Linear(5, 5, dtype=F64), nn.ReLU()) for _ in range(30)]
        return nn.Sequential(nn.Sequential(*blocks[:15]), nn.Sequential(*blocks[15:]), nn.Linear(5, 3, dtype=F64))


def test_a_deep_model_is_grouped_by_block_with_every_layer_on_disk(make_config):
    cfg = make_config(devices__use="cpu:0", train__steps=2, data__batch_size=16, health__every=2, health__groups=8)
    health = Health()
    trainer = Trainer(cfg, callbacks=[health], task=Deep())
    assert trainer.run().status == "finished"
    (rec,) = health.records
    assert rec["rows"] == ["0", "1", "2"]  # 31 layers, by top-level block
    assert len(rec["grad_norm"]) == 3 and all(v > 0 for v in rec["grad_norm"])
    assert len(rec["act_rows"]) <= 8
    full = json.loads((trainer.run_dir.path / "health_layers.jsonl").read_text())
    assert len(full["names"]) == 31 and len(full["grad_norm"]) == 31
    # a block's gradient norm is the norm over all its layers
    sq = [v * v for v in full["grad_norm"][:15]]
    assert rec["grad_norm"][0] == pytest.approx(sum(sq) ** 0.5, rel=2e-3)


def test_health_off_writes_no_health(make_config):
    cfg = make_config(train__steps=4, data__batch_size=16, health__enabled=False, health__every=1)
    health, logs = Health(), []
    trainer = Trainer(cfg, callbacks=[health], task=Small())
    trainer.callbacks.append(type("L", (TrainerCallback,), {"on_log": lambda self, r: logs.append(r)})())
    assert trainer.run().status == "finished"
    assert health.records == [] and logs and not any("noise" in r for r in logs)
    assert not (trainer.run_dir.path / "health_layers.jsonl").exists()


@pytest.mark.parametrize(
    "broken",
    [
        {"kind": "health", "step": 3, "rows": "a", "grad_norm": [1.0]},
        {"kind": "health", "step": 3, "rows": ["a", "b"], "grad_norm": [1.0]},
        {"kind": "health", "step": 3, "rows": ["a"], "grad_norm": ["x"]},
        {"kind": "train", "step": 3, "loss": 1.0, "noise": {"b_simple": "big"}},
    ],
)
def test_readers_skip_a_broken_health_record(broken):
    assert parse_record(json.dumps(broken).encode()) is None


def test_readers_take_a_health_record_with_gaps():
    rec = {"kind": "health", "step": 3, "rows": ["a", "b"], "grad_norm": [1.0, None], "act_rows": [], "act_mean": []}
    assert parse_record(json.dumps(rec).encode()) == rec
