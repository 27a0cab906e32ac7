"""The task every correctness check trains: a file task, as a user writes one, so that the ddp ranks load it too.

``model`` picks what is trained (each a small regression whose full-batch gradient the check can
compute by hand): ``mlp`` (Linear/Tanh), ``batchnorm`` (Linear, BatchNorm1d, Linear; trained with
``devices.sync_batchnorm`` on several devices), ``dropout`` (dropout inside a block run under
``torch.utils.checkpoint`` when ``checkpoint`` is true), ``wide`` (one hidden layer of ``width`` units:
the out-of-memory check's model, whose activations grow with the batch). Data: ``samples`` rows, float32.
"""

from __future__ import annotations

import torch
from multilane.engine.tasks import ArrayData, Task
from pydantic import BaseModel, Field
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

FEATURES = 32
WIDTH = 64


class Params(BaseModel):
    model: str = Field("mlp", pattern="^(mlp|batchnorm|dropout|wide)$")
    width: int = Field(1 << 20, ge=1, description="wide: the hidden width (its activations: batch x width floats)")
    checkpoint: bool = True
    dropout: float = Field(0.2, ge=0.0, lt=1.0)
    samples: int = Field(96, ge=2)
    init_seed: int = 11


class DropoutNet(nn.Module):
    def __init__(self, p: float, use_checkpoint: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, WIDTH)
        self.block = nn.Sequential(nn.Tanh(), nn.Dropout(p), nn.Linear(WIDTH, WIDTH), nn.Tanh())
        self.drop = nn.Dropout(p)
        self.out = nn.Linear(WIDTH, 1)
        self.use_checkpoint = use_checkpoint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = checkpoint(self.block, h, use_reentrant=False) if self.use_checkpoint else self.block(h)
        return self.out(self.drop(h))


def build(params: Params) -> nn.Module:
    """The model with weights from its own seed: the engine and the hand loop start from the same weights
    without sharing the process's random stream (which the engine's lanes draw dropout from)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(params.init_seed)
        if params.model == "mlp":
            return nn.Sequential(
                nn.Linear(FEATURES, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1)
            )
        if params.model == "batchnorm":
            return nn.Sequential(nn.Linear(FEATURES, WIDTH), nn.BatchNorm1d(WIDTH), nn.ReLU(), nn.Linear(WIDTH, 1))
        if params.model == "wide":
            return nn.Sequential(nn.Linear(FEATURES, params.width), nn.Tanh(), nn.Linear(params.width, 1))
        return DropoutNet(params.dropout, params.checkpoint)


def dataset(samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(samples, FEATURES, generator=g)
    return x, (x[:, :4].sum(dim=1, keepdim=True)).sin()


class GpuCheckTask(Task):
    name = "gpu-check"
    Params = Params

    def build_model(self) -> nn.Module:
        return build(self.params)

    def data(self) -> ArrayData:
        return ArrayData(*dataset(self.params.samples))

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output.float(), target)
