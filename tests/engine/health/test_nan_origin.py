"""Where a NaN began, found by replaying the log window from the state kept before it.

Three ways a run goes non-finite: a module that makes inf from one sample, a learning rate that blows
the weights up, a NaN in the data. Each names the step, the first module (or the data) that went
non-finite, the device, and the samples; one line in status.json, the detail in nan_origin.json.
"""

from __future__ import annotations

import json

import pytest
import torch
from multilane.engine.data.order import epoch_order
from multilane.engine.parallel import chunk_sizes
from multilane.engine.run.trainer import Trainer
from multilane.engine.tasks import ArrayData, Task
from torch import nn

F64 = torch.float64
N, BATCH = 120, 24


class Reciprocal(nn.Module):
    """1 / x[:, 0]: inf for a sample whose first feature is exactly 0."""

    def forward(self, x):
        return x / x[:, :1]


class Regression(Task):
    name = "regression"

    def __init__(self, bad: int | None = None, how: str = "none") -> None:
        super().__init__()
        self.bad, self.how = bad, how

    def build_model(self):
        return nn.Sequential(nn.Linear(4, 4, dtype=F64), nn.Tanh(), nn.Linear(4, 1, dtype=F64))

    def data(self):
        g = torch.Generator().manual_seed(7)
        x = torch.randn(N, 4, generator=g, dtype=F64)
        y = torch.randn(N, 1, generator=g, dtype=F64)
        if self.how == "nan_data":
            x[self.bad, 2] = float("nan")
        return ArrayData(x, y), None

    def loss(self, output, target):
        return nn.functional.mse_loss(output, target)


def where_sample(sample: int, lanes: int) -> tuple[int, str]:
    """The first step whose batch holds ``sample``, and the lane its shard goes to (plain arithmetic
    on the run's documented order: epoch 0's permutation, batches of BATCH, even shards)."""
    order = epoch_order(N, 0, 0).tolist()
    pos = order.index(sample)
    step, row = divmod(pos, BATCH)
    sizes = chunk_sizes(BATCH, lanes)
    lane = next(k for k in range(lanes) if row < sum(sizes[: k + 1]))
    return step + 1, f"cpu:{lane}"


def run(make_config, task, devices="cpu:0,cpu:1", **over):
    base = {
        "train__steps": 5,
        "train__log_every": 5,
        "data__batch_size": BATCH,
        "optim__name": "sgd",
        "optim__lr": 0.01,
    }
    cfg = make_config(devices__use=devices, **(base | over))
    trainer = Trainer(cfg, task=task)
    result = trainer.run()
    assert result.status == "diverged"
    status = json.loads((trainer.run_dir.path / "status.json").read_text())
    detail = json.loads((trainer.run_dir.path / "nan_origin.json").read_text())
    return result, status, detail, trainer


@pytest.mark.parametrize("strategy", ["replicate", "persistent"])
def test_a_module_making_inf_from_one_sample_is_named_with_its_device_and_sample(make_config, strategy):
    sample = 61
    step, device = where_sample(sample, 2)

    class ZeroInput(Regression):
        def build_model(self):
            return nn.Sequential(Reciprocal(), nn.Linear(4, 4, dtype=F64), nn.Linear(4, 1, dtype=F64))

        def data(self):
            data, val = super().data()
            data.inputs[sample, 0] = 0.0  # this sample's feature 0 is exactly 0: x / 0
            return data, val

    result, status, detail, trainer = run(make_config, ZeroInput(), devices__strategy=strategy)
    line = result.message
    assert line.startswith(f"loss became nan at step {step}: first non-finite output in 0 on {device}")
    assert f"from samples {sample}; first non-finite gradient in 2.weight on {device}" in line
    assert status["message"] == line
    assert detail["step"] == step and detail["samples"] == [sample]
    assert not trainer.health.muted and trainer.health.every  # the run's monitor is its own again after the replay
    assert detail["outputs"] == {device: {"module": "0", "rows": detail["outputs"][device]["rows"]}}
    # the run's own state is the one it noticed the NaN in, not the replay's
    assert trainer.step == 5
    events = [json.loads(x) for x in (trainer.run_dir.path / "metrics.jsonl").read_text().splitlines()]
    found = [e for e in events if e.get("event") == "nonfinite_origin"]
    assert [(e["kind"], e["message"], e["origin_step"], e["device"]) for e in found] == [("event", line, step, device)]


def test_a_nan_in_the_data_is_named_as_the_data(make_config):
    sample = 17
    step, device = where_sample(sample, 3)
    result, _status, detail, _ = run(make_config, Regression(sample, "nan_data"), devices="cpu:0,cpu:1,cpu:2")
    assert result.message == (
        f"loss became nan at step {step}: non-finite values in the input data on {device}, from samples {sample}"
        + f"; first non-finite gradient in 2.weight on {device}"
    ) or result.message.startswith(
        f"loss became nan at step {step}: non-finite values in the input data on {device}, from samples {sample}"
    )
    assert detail["inputs"] == {device: detail["inputs"][device]} and detail["samples"] == [sample]


class BlowUp(Regression):
    def build_model(self):
        return nn.Sequential(nn.Linear(4, 16), nn.Linear(16, 1))  # float32: overflows within a few steps

    def data(self):
        g = torch.Generator().manual_seed(7)
        return ArrayData(100 * torch.randn(N, 4, generator=g), torch.randn(N, 1, generator=g)), None


def first_nonfinite_step(lr: float, steps: int) -> int:
    """The plain loop on one device: the first step whose output, loss or gradient is not finite."""
    torch.manual_seed(0)
    task = BlowUp()
    model, data = task.build_model(), task.data()[0]
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(1, steps + 1):
        idx = epoch_order(N, 0, (step - 1) // (N // BATCH))[((step - 1) % (N // BATCH)) * BATCH :][:BATCH]
        out = model(data.inputs[idx])
        loss = task.loss(out, data.target[idx])
        opt.zero_grad()
        loss.backward()
        values = [out, loss, *[p.grad for p in model.parameters()]]
        if not all(bool(torch.isfinite(v).all()) for v in values):
            return step
        opt.step()
    raise AssertionError("stayed finite")


def test_a_learning_rate_that_blows_up_is_traced_to_its_first_step(make_config):
    expect = first_nonfinite_step(10.0, 20)
    assert expect > 1
    result, _, detail, _ = run(
        make_config, BlowUp(), devices="cpu:0", optim__lr=10.0, train__steps=20, train__log_every=20
    )
    line = result.message
    assert detail["step"] == expect and f" at step {expect}: " in line
    assert "first non-finite" in line and " on cpu:0" in line
    assert detail["replayed_from_step"] == 0


def test_a_finite_run_keeps_state_but_writes_no_origin(make_config):
    cfg = make_config(train__steps=4, data__batch_size=BATCH)
    trainer = Trainer(cfg, task=Regression())
    assert trainer.run().status == "finished"
    assert trainer.run_health.kept is not None and trainer.run_health.kept.step == 3
    assert not (trainer.run_dir.path / "nan_origin.json").exists()


def test_the_kept_state_reuses_its_buffers_and_holds_the_state_as_it_was():
    # Every log window copies the model's and the optimizer's state into the last window's copy: the same
    # tensors, refilled, never the live ones; the optimizer's settings as they were; a state that changed
    # shape gets a fresh tensor.
    from multilane.engine.health.nan_origin import _copy_into

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.8, 0.9))

    def step() -> None:
        opt.zero_grad()
        model(torch.randn(5, 3)).square().mean().backward()
        opt.step()

    step()
    kept = (_copy_into(None, model.state_dict()), _copy_into(None, opt.state_dict()))
    step()
    again = (_copy_into(kept[0], model.state_dict()), _copy_into(kept[1], opt.state_dict()))
    for name, t in model.state_dict().items():
        assert (
            again[0][name] is kept[0][name]
            and torch.equal(t, again[0][name])
            and t.data_ptr() != again[0][name].data_ptr()
        )
    live = opt.state_dict()
    for i, st in live["state"].items():
        for k, v in st.items():
            assert again[1]["state"][i][k] is kept[1]["state"][i][k] and torch.equal(v, again[1]["state"][i][k])
    assert again[1]["param_groups"] == live["param_groups"]
    assert again[1]["param_groups"][0]["lr"] == 0.1 and again[1]["param_groups"][0]["betas"] == (0.8, 0.9)
    grown = _copy_into(again[0], {**model.state_dict(), "0.weight": torch.ones(2, 2)})
    assert grown["0.weight"] is not again[0]["0.weight"] and grown["0.weight"].shape == (2, 2)
