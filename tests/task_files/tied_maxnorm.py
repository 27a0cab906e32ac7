"""Embedding(max_norm) tied to the output layer: the forward renormalises embedding rows in place."""

import torch
from multilane.engine.tasks import ArrayData, Task
from torch import nn
from torch.nn import functional as F


class TiedMaxNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(17, 6, max_norm=1.0)
        self.out = nn.Linear(6, 17, bias=False)
        self.out.weight = self.emb.weight
        with torch.no_grad():
            self.emb.weight.mul_(3.0)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.emb(tokens).mean(dim=1)))


class TiedMaxNormTask(Task):
    name = "tied-maxnorm"

    def build_model(self) -> nn.Module:
        return TiedMaxNorm().double()

    def data(self) -> ArrayData:
        g = torch.Generator().manual_seed(9)
        tokens = torch.randint(0, 17, (80, 3), generator=g)
        return ArrayData(tokens, tokens[:, 0])

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, target)
