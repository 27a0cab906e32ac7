"""Where a NaN began, in the runs that used to lose it: a bad sample in a later micro-batch of an
accumulated step (on a device with an uneven share), a huge finite input that overflows only later
(in the loss, or after a layer that mixes the batch), a resume from a checkpoint saved in the middle of
the log window that went bad, and a learning rate that blows the weights up. Each names the sample
(or the layer) that plain arithmetic on the run's documented order, or a plain one-device loop,
names — exactly."""

from __future__ import annotations

import json

import pytest
import torch
from multilane.engine.cli.watch import WatchState
from multilane.engine.data.order import epoch_order
from multilane.engine.health.diagnosis import diagnose
from multilane.engine.parallel import chunk_sizes
from multilane.engine.run.trainer import Trainer
from multilane.engine.tasks import ArrayData, Task
from torch import nn

F64 = torch.float64
N, BATCH = 120, 24


class Reciprocal(nn.Module):
    """x / x[:, 0]: inf for a sample whose first feature is exactly 0."""

    def forward(self, x):
        return x / x[:, :1]


class BatchEnergy(nn.Module):
    """x minus the batch's mean square: every row inf once one row's square overflows."""

    def forward(self, x):
        return x - x.square().mean(0)


class Planted(Task):
    """A regression with one planted sample: ``zero`` (its feature 0 is 0: the first module makes inf
    from it), ``huge`` (its features are 1e30: finite in float32, until a later op squares them) or
    ``large`` (1e15: every value of its step stays finite, but its update blows the weights up, and
    the next step overflows on every sample)."""

    name = "planted"

    def __init__(self, bad: int, how: str, model: str = "plain") -> None:
        super().__init__()
        self.bad, self.how, self.model = bad, how, model

    def build_model(self):
        if self.how == "zero":
            return nn.Sequential(Reciprocal(), nn.Linear(4, 4, dtype=F64), nn.Linear(4, 1, dtype=F64))
        if self.model == "mixing":  # a layer that mixes the batch: one sample's overflow reaches every row
            return nn.Sequential(nn.Linear(4, 8), BatchEnergy(), nn.Linear(8, 1))
        return nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))  # its output is finite; the squared error is not

    def data(self):
        g = torch.Generator().manual_seed(7)
        dtype = F64 if self.how == "zero" else torch.float32
        x = torch.randn(N, 4, generator=g, dtype=dtype)
        y = torch.randn(N, 1, generator=g, dtype=dtype)
        if self.how == "zero":
            x[self.bad, 0] = 0.0
        else:  # 1e30: squared, it overflows in that step; 1e15: its update makes the weights ~1e27
            x[self.bad] = 1e30 if self.how == "huge" else 1e15
        return ArrayData(x, y), None

    def loss(self, output, target):
        return nn.functional.mse_loss(output, target)


def at(pos: int, lanes: int, weights: list[float] | None = None, accum: int = 1) -> tuple[int, int, str]:
    """The sample at position ``pos`` of epoch 0's order, the step that trains on it and its device:
    plain arithmetic on the documented order (micro-batches of BATCH, ``accum`` per step, shards by
    ``chunk_sizes``)."""
    sample = epoch_order(N, 0, 0).tolist()[pos]
    micro, row = divmod(pos, BATCH)
    sizes = chunk_sizes(BATCH, lanes, weights)
    lane = next(k for k in range(lanes) if row < sum(sizes[: k + 1]))
    return sample, micro // accum + 1, f"cpu:{lane}"


def diverge(make_config, task, **over):
    base = {
        "train__steps": 4,
        "train__log_every": 4,
        "data__batch_size": BATCH,
        "optim__name": "sgd",
        "optim__lr": 0.01,
        "devices__use": "cpu:0,cpu:1",
        "telemetry__enabled": False,
    }
    trainer = Trainer(make_config(**(base | over)), task=task)
    result = trainer.run()
    assert result.status == "diverged", result.message
    status = json.loads((trainer.run_dir.path / "status.json").read_text())
    detail = json.loads((trainer.run_dir.path / "nan_origin.json").read_text())
    assert status["message"] == result.message
    return result.message, detail, trainer


@pytest.mark.parametrize("strategy", ["replicate", "persistent"])
def test_accumulation_names_the_bad_sample_of_the_later_micro_batch_on_its_device(make_config, strategy):
    # the 2nd micro-batch of step 1, row 20: device cpu:1 under shares 1:2 (8 and 16 rows)
    sample, step, device = at(BATCH + 20, 2, [1.0, 2.0], accum=2)
    assert (step, device) == (1, "cpu:1")
    line, detail, _ = diverge(
        make_config,
        Planted(sample, "zero"),
        train__grad_accum=2,
        devices__weights=[1.0, 2.0],
        devices__strategy=strategy,
    )
    assert line.startswith(
        f"loss became nan at step {step}: first non-finite output in 0 on {device}, from samples {sample};"
    )
    assert detail["samples"] == [sample] and detail["micro_batch"] == 1


@pytest.mark.parametrize(("how", "model"), [("huge", "plain"), ("huge", "mixing"), ("large", "plain")])
def test_a_huge_finite_input_that_overflows_later_names_its_sample(make_config, how, model):
    sample, step, device = at(2 * BATCH + 5, 2, accum=1)  # step 3, cpu:0
    line, detail, _ = diverge(make_config, Planted(sample, how, model))
    named = f"samples {sample} (standing out in the input data: ≥1000× the batch's median |value|)"
    assert detail["samples"] == [sample], line
    if how == "large":  # step 3 stays finite; its update of layer 1 makes step 4 overflow on every sample
        assert f" at step {step + 1}: " in line and f"; step {step}'s batch held {named}" in line
        assert detail["updates"]["blew_up"]["step"] == step and detail["updates"]["samples"] == [sample]
        return
    kind, what = {  # squared in the loss / every row non-finite after the mixing layer
        "plain": ("loss", f"the loss on {device} was not"),
        "mixing": ("output", f"first non-finite output in 1 on {device}"),
    }[model]
    assert f" at step {step}: " in line and f"{what}, from {named}" in line
    assert detail["kind"] == kind


def test_a_resume_mid_window_traces_the_nan_and_never_loses_a_better_origin(make_config, tmp_path):
    sample, step, device = at(3 * BATCH + 3, 2)  # step 4 of a window of steps 1-5, checkpoint at 3
    over = {"train__steps": 5, "train__log_every": 5, "train__checkpoint_every": 3}
    first, first_detail, trainer = diverge(make_config, Planted(sample, "zero"), **over)
    run_dir = trainer.run_dir.path
    assert f" at step {step}: " in first and first_detail["replayed_from_step"] == 0
    # resumed from step 3, in the middle of the window: the replay starts at the resume
    resumed = Trainer(resume_from=run_dir, task=Planted(sample, "zero"))
    result = resumed.run()
    same = f"loss became nan at step {step}: first non-finite output in 0 on {device}, from samples {sample};"
    assert result.status == "diverged" and first.startswith(same) and result.message.startswith(same)
    detail = json.loads((run_dir / "nan_origin.json").read_text())
    assert detail["replayed_from_step"] == 3 and detail["samples"] == [sample]
    second = result.message
    # again without a replay: the weaker "between steps" line must not replace the origin
    again = Trainer(resume_from=run_dir, task=Planted(sample, "zero"), overrides={"health": {"nan_replay": False}})
    result = again.run()
    status = json.loads((run_dir / "status.json").read_text())
    assert result.status == "diverged" and result.message == second == status["message"]
    events = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [e["message"] for e in events if e.get("event") == "nonfinite_origin"] == [first, second, second]


class BlowUp(Task):
    name = "blowup"

    def build_model(self):
        return nn.Sequential(nn.Linear(4, 16), nn.Linear(16, 1))  # float32: overflows within a few steps

    def data(self):
        g = torch.Generator().manual_seed(7)
        return ArrayData(100 * torch.randn(N, 4, generator=g), torch.randn(N, 1, generator=g)), None

    def loss(self, output, target):
        return nn.functional.mse_loss(output, target)


def plain_blow_up(lr: float, steps: int) -> tuple[int, str, int, list[float]]:
    """The plain loop on one device: the first non-finite step, and the first layer (at its step) whose
    ``|Δw| / |w|`` reached 0.1 before it, with that layer's weight norms after each step."""
    torch.manual_seed(0)
    task = BlowUp()
    model, data = task.build_model(), task.data()[0]
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    blew, norms = None, {}
    for step in range(1, steps + 1):
        idx = epoch_order(N, 0, (step - 1) // (N // BATCH))[((step - 1) % (N // BATCH)) * BATCH :][:BATCH]
        out = model(data.inputs[idx])
        loss = task.loss(out, data.target[idx])
        opt.zero_grad()
        loss.backward()
        if not all(bool(torch.isfinite(v).all()) for v in [out, loss, *[p.grad for p in model.parameters()]]):
            assert blew is not None
            return step, blew[0], blew[1], norms[blew[0]]
        before = {
            n: torch.cat([p.detach().reshape(-1).clone() for p in m.parameters()]) for n, m in model.named_children()
        }
        opt.step()
        ratios = {}
        for n, m in model.named_children():
            now = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
            ratios[n] = float((now - before[n]).norm() / before[n].norm())
            norms.setdefault(n, []).append(float(now.norm()))
        over = [(r, n) for n, r in ratios.items() if r >= 0.1]
        if blew is None and over:
            blew = (max(over)[1], step)
    raise AssertionError("stayed finite")


def test_an_exploding_learning_rate_names_the_layer_whose_updates_blew_up_first(make_config):
    step, layer, when, norms = plain_blow_up(10.0, 20)
    line, detail, trainer = diverge(
        make_config, BlowUp(), devices__use="cpu:0", optim__lr=10.0, train__steps=20, train__log_every=20
    )
    assert detail["step"] == step and detail["samples"] == []
    assert f"; before it |Δw|/|w| of {layer} passed 0.1 first, at step {when} (steps 1–{step - 1}: " in line
    assert f", its weight norm {norms[0]:.2g} → {norms[step - 2]:.2g}; step {step - 1}'s |Δw|/|w| by layer: " in line
    updates = detail["updates"]
    assert updates["blew_up"]["layer"] == layer == detail["layer"] and updates["steps"] == list(range(1, step))
    assert updates["weight_norm"][-1][updates["layers"].index(layer)] == pytest.approx(norms[step - 2], rel=1e-3)
    # `multilane watch` prints it, and the Health view's diagnosis selects that layer's row
    watch = WatchState()
    watch.set_status(json.loads((trainer.run_dir.path / "status.json").read_text()))
    assert watch.line().endswith(f"({line})")
    records = [json.loads(x) for x in (trainer.run_dir.path / "metrics.jsonl").read_text().splitlines()]
    (event,) = [r for r in records if r.get("event") == "nonfinite_origin"]
    assert (diagnose([], event)[0].row, diagnose([], event)[0].quantity) == (layer, "update_ratio")
    # a window that begins at that step has no update to show, and says so
    line, _, _ = diverge(
        make_config, BlowUp(), devices__use="cpu:0", optim__lr=10.0, train__steps=4, train__log_every=step - 1
    )
    assert line.endswith(f"; no update replayed before it (the replay began at step {step})"), line
