"""A float64 model with what ddp must treat as lanes do: BatchNorm (running statistics), dropout, two
output heads (an empty shard must reach both) and, optionally, a layer the forward never uses.

Input ``(N, 4, 5)`` (BatchNorm1d over 6 channels of length 5, so one sample still has 5 values per
channel); target ``(N, 2)``, one column per head. 23 of ``samples`` = 31 train in batches of
``data.batch_size`` = 11: every third batch holds one sample, so some ranks have none.
"""

import torch
from multilane.engine.tasks import ArrayData, Task
from pydantic import BaseModel
from torch import nn
from torch.nn import functional as F


class Params(BaseModel):
    dropout: float = 0.3
    unused: bool = True
    samples: int = 31


class Heads(nn.Module):
    def __init__(self, dropout: float, unused: bool) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 6, 1, bias=False)  # a bias before BatchNorm has no gradient but rounding
        self.bn = nn.BatchNorm1d(6)
        self.drop = nn.Dropout(dropout)
        self.a = nn.Linear(30, 1)
        self.b = nn.Linear(30, 1)
        if unused:
            self.unused = nn.Linear(3, 3)  # never called: no gradient on one device

    def forward(self, x):
        h = self.drop(torch.tanh(self.bn(self.conv(x)))).flatten(1)
        return self.a(h), self.b(h)


class DdpKinds(Task):
    name = "ddpkinds"
    Params = Params
    metric = "mae"

    def build_model(self) -> nn.Module:
        return Heads(self.params.dropout, self.params.unused).double()

    def data(self) -> ArrayData:
        g = torch.Generator().manual_seed(7)
        x = torch.randn(self.params.samples, 4, 5, generator=g, dtype=torch.float64)
        y = torch.stack([x.sum(dim=(1, 2)).sin(), x[:, 0].mean(dim=1).cos()], dim=1)
        return ArrayData(x, y)

    def loss(self, output, target):
        a, b = output
        return F.mse_loss(a, target[:, :1]) + F.mse_loss(b, target[:, 1:])

    def metrics(self, output, target):
        return {"mae": (output[0] - target[:, :1]).abs().mean()}
