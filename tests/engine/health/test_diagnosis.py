"""The diagnosis names the planted faults of a real run, from its own health records: a ReLU layer whose
bias kills every unit (dead), a layer whose learning rate rewrites it each step (update/weight far above
1e-3), and a layer cut off from the loss (gradient norm 0); the healthy layers are not named."""

from __future__ import annotations

import pytest
import torch
from multilane.engine.health.diagnosis import diagnose
from multilane.engine.run.trainer import Trainer
from multilane.engine.tasks import ArrayData, Task
from test_layers import Health
from torch import nn

F64 = torch.float64


class Cut(nn.Module):
    """Adds its layer's output times zero: the layer is in the graph, but no gradient reaches it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6, dtype=F64)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + 0.0 * self.lin(h)


class Planted(Task):
    name = "planted"

    def build_model(self) -> nn.Module:
        model = nn.Sequential(
            nn.Linear(4, 6, dtype=F64),
            nn.Tanh(),
            Cut(),
            nn.Linear(6, 6, dtype=F64),
            nn.ReLU(),
            nn.Linear(6, 2, dtype=F64),
        )
        with torch.no_grad():
            model[3].bias.fill_(-100.0)  # every unit of the ReLU after it: dead from the start
            model[5].weight.mul_(1e-3)  # a tiny weight that SGD at lr 1 rewrites each step
        return model

    def data(self) -> ArrayData:
        g = torch.Generator().manual_seed(3)
        return ArrayData(torch.randn(64, 4, generator=g, dtype=F64), torch.randn(64, 2, generator=g, dtype=F64))

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(output, target)


@pytest.mark.slow
def test_the_diagnosis_names_the_planted_faults_of_a_real_run(make_config):
    cfg = make_config(
        devices__use="cpu:0,cpu:1",
        train__steps=4,
        data__batch_size=16,
        optim__name="sgd",
        optim__lr=1.0,
        optim__momentum=0.0,
        health__every=1,
        health__activations="ReLU, Tanh",
        health__groups=4096,
    )
    records = Health()
    assert Trainer(cfg, callbacks=[records], task=Planted()).run().status == "finished"
    found = {(f.row, f.quantity) for f in diagnose(records.records)}
    # the dead ReLU passes no gradient back: layers 0 and 3 get none, as the cut-off 2.lin; the last layer's
    # tiny weight is rewritten each step; the Tanh (alive) is not named
    assert found == {
        ("4 (ReLU)", "act_zero"),
        ("0", "grad_norm"),
        ("2.lin", "grad_norm"),
        ("3", "grad_norm"),
        ("5", "update_ratio"),
    }, found


def test_gradients_shrinking_everywhere_as_the_loss_falls_are_not_vanishing_one_layer_alone_is():
    def records(last: list[float]) -> list[dict]:
        history = [{"step": s, "rows": ["a", "b", "c"], "grad_norm": [1.0, 2.0, 3.0]} for s in (1, 2, 3, 4)]
        return [*history, {"step": 5, "rows": ["a", "b", "c"], "grad_norm": last}]

    assert diagnose(records([0.1, 0.2, 0.3])) == []  # every layer kept a tenth: convergence, not a fault
    (finding,) = diagnose(records([0.005, 1.0, 1.5]))  # "a" kept 1/200 where the others kept half
    assert (finding.row, finding.quantity) == ("a", "grad_norm") and finding.text.endswith("(vanishing)")
    (finding,) = diagnose(records([1.0, 40.0, 3.0]))
    assert finding.row == "b" and "20× its usual" in finding.text and finding.text.endswith("(exploding)")
