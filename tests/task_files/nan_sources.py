"""A float64 regression that goes non-finite on purpose, for the NaN-origin tests under ddp
(tests/engine/health/test_nan_origin_ddp.py): ``how`` = ``zero_input`` makes sample ``bad``'s first
feature exactly 0, which the model's first module (``0``: x / x[:, :1]) turns into inf; ``nan_data``
puts a NaN in sample ``bad``'s data. 120 samples of 4 features, no validation split."""

import torch
from multilane.engine.tasks import ArrayData, Task
from pydantic import BaseModel
from torch import nn

F64 = torch.float64


class Params(BaseModel):
    bad: int = 61
    how: str = "zero_input"


class Reciprocal(nn.Module):
    def forward(self, x):
        return x / x[:, :1]


class NanSources(Task):
    name = "nansources"
    Params = Params

    def build_model(self):
        return nn.Sequential(Reciprocal(), nn.Linear(4, 4, dtype=F64), nn.Tanh(), nn.Linear(4, 1, dtype=F64))

    def data(self):
        g = torch.Generator().manual_seed(7)
        x = torch.randn(120, 4, generator=g, dtype=F64)
        y = torch.randn(120, 1, generator=g, dtype=F64)
        if self.params.how == "zero_input":
            x[self.params.bad, 0] = 0.0
        else:
            x[self.params.bad, 2] = float("nan")
        return ArrayData(x, y), None

    def loss(self, output, target):
        return nn.functional.mse_loss(output, target)
