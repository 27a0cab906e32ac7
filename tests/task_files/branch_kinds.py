"""A float64 model with a data-dependent branch: ``extra`` runs only on the samples whose first feature is
above 2, and not at all on a batch without one, so some ranks' (and lanes') shards skip it at some steps
while others take it, and a step where no shard holds such a sample leaves it without a gradient. Each
sample's output depends on that sample alone, so every strategy can match one device exactly.

``kind`` picks the shape: ``branch`` (one optional layer), ``experts`` (a hard mixture: each sample goes
to the expert its first feature picks, so an expert only some shards' samples pick gets a gradient there
alone) or ``output`` (the layer runs on every shard, and its output enters the loss only on a shard with
such a sample: the layer's forward runs everywhere, its gradient comes from some shards only). ``rare`` samples (the first ones of the data set, which the shuffled order spreads) take the branch.
"""

from typing import Literal

import torch
from multilane.engine.tasks import ArrayData, Task
from pydantic import BaseModel
from torch import nn
from torch.nn import functional as F


class Params(BaseModel):
    kind: Literal["branch", "experts", "output"] = "branch"
    samples: int = 40
    rare: int = 3


class Branch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 6)
        self.extra = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        h = torch.tanh(self.body(x))
        rows = x[:, 0] > 2.0
        if rows.any():  # a layer only some samples reach: a shard without such a sample skips it
            h = h.clone()
            h[rows] = h[rows] + self.extra(h[rows])
        return self.head(h)


class OptionalOutput(Branch):
    def forward(self, x):
        h = torch.tanh(self.body(x))
        e = self.extra(h)  # every shard runs the layer
        rows = x[:, 0] > 2.0
        if rows.any():  # only a shard with such a sample uses its output
            h = torch.where(rows[:, None], h + e, h)
        return self.head(h)


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 6)
        self.experts = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        h = torch.tanh(self.body(x))
        pick = (x[:, 0] > 2.0).long() + (x[:, 0] > 3.0).long()  # mostly expert 0
        out = torch.zeros_like(h)
        for k, expert in enumerate(self.experts):
            rows = pick == k
            if rows.any():  # an expert no sample of this shard picks does not run
                out[rows] = expert(h[rows])
        return self.head(h + out)


class BranchKinds(Task):
    name = "branchkinds"
    Params = Params
    metric = "mae"

    def build_model(self) -> nn.Module:
        return {"branch": Branch, "experts": Experts, "output": OptionalOutput}[self.params.kind]().double()

    def data(self) -> ArrayData:
        g = torch.Generator().manual_seed(11)
        n = self.params.samples
        x = torch.randn(n, 8, generator=g, dtype=torch.float64).clamp(-1.9, 1.9)
        x[: self.params.rare, 0] = torch.linspace(2.5, 3.5, self.params.rare, dtype=torch.float64)
        y = torch.stack([x[:, 1:3].sum(1).sin(), x[:, 3].cos(), x[:, 4] * x[:, 5]], dim=1)
        return ArrayData(x, y)

    def loss(self, output, target):
        return F.mse_loss(output, target)

    def metrics(self, output, target):
        return {"mae": (output - target).abs().mean()}
