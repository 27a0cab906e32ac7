"""Exactness end to end: custom task files trained by the Trainer on 1, 2 and 3 lanes equal a hand loop.

The reference is the loop a user writes for one device, on the very batches the trainer takes (same
task, seed and split), in float64; the validation loss is the loss of the whole validation set at once.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import TASK_FILES
from multilane.engine.run.trainer import Trainer, TrainerCallback

TASKS = TASK_FILES
BOUND = 1e-10
SPLITS = [("cpu:0", None), ("cpu:0,cpu:1", [1, 3]), ("cpu:0,cpu:1,cpu:2", None), ("cpu:0,cpu:1,cpu:2", [3, 1, 2])]


class Records(TrainerCallback):
    def __init__(self) -> None:
        self.train: list[dict] = []
        self.eval: list[dict] = []

    def on_log(self, record: dict) -> None:
        self.train.append(record)

    def on_eval(self, record: dict) -> None:
        self.eval.append(record)


def config(make_config, task: str, devices: str, weights):
    return make_config(
        task__name=str(TASKS / task),
        devices__use=devices,
        devices__weights=weights or [],
        train__steps=6,
        data__batch_size=12,
        optim__name="sgd",
        optim__lr=0.1,
        optim__momentum=0.9,
    )


def hand_loop(cfg) -> tuple[torch.nn.Module, list[float], float]:
    ref = Trainer(cfg)
    ref._setup()  # the task, its seeded model, and the very batches and split the run takes
    ref.backend.close()
    model, task = ref.model, ref.task
    opt = torch.optim.SGD(model.parameters(), lr=cfg.optim.lr, momentum=cfg.optim.momentum)
    losses = []
    for m in range(cfg.train.steps):
        x, y, _ = ref.loader.batches.get(m)
        loss = task.loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        val = task.loss(model(ref.loader.val.inputs), ref.loader.val.target).item()
    return model, losses, val


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-300)


@pytest.mark.parametrize(("devices", "weights"), SPLITS)
@pytest.mark.parametrize("task", ["padded_tokens.py", "tied_maxnorm.py"])
def test_a_custom_task_trains_on_lanes_as_on_one_device(make_config, task, devices, weights):
    cfg = config(make_config, task, devices, weights)
    ref_model, ref_losses, ref_val = hand_loop(cfg)
    records = Records()
    trainer = Trainer(cfg, callbacks=[records])
    result = trainer.run()
    assert result.status == "finished", result.message
    assert [r["step"] for r in records.train] == list(range(1, 7))
    assert max(rel(r["loss"], b) for r, b in zip(records.train, ref_losses, strict=True)) <= BOUND
    for (name, p), q in zip(trainer.model.named_parameters(), ref_model.parameters(), strict=True):
        assert ((p - q).abs().max() / q.abs().max()).item() <= BOUND, name
    # The validation loss: the whole validation set's token mean, in float64 (not rounded to float32).
    assert rel(records.eval[-1]["val_loss"], ref_val) <= BOUND


def test_metrics_of_a_dataclass_output_do_not_depend_on_the_lane_count(make_config):
    def final_eval(devices, weights):
        records = Records()
        Trainer(config(make_config, "padded_tokens.py", devices, weights), callbacks=[records]).run()
        return records.eval[-1]

    one = final_eval("cpu:0", None)
    three = final_eval("cpu:0,cpu:1,cpu:2", [3, 1, 2])
    assert math.isfinite(one["metrics"]["token_accuracy"])
    assert three["metrics"]["token_accuracy"] == pytest.approx(one["metrics"]["token_accuracy"], rel=1e-12)
    assert three["val_loss"] == pytest.approx(one["val_loss"], rel=1e-12)
