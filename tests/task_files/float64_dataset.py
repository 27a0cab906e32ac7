"""The float64 regression of tests/helpers.py read through a torch Dataset (or a stream).

``kind``: "map" (one map-style Dataset, split by the engine), "pair" (a training and a validation
Dataset) or "stream" (two IterableDatasets). ``noise``: a random augmentation drawn from all three
generators a transform may use (torch, random, numpy), for map-style data.
"""

import random
from typing import Literal

import numpy as np
import torch
from multilane.engine.tasks import Task
from pydantic import BaseModel
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset, IterableDataset


class Params(BaseModel):
    kind: Literal["map", "pair", "stream"] = "map"
    noise: bool = False
    samples: int = 96


class Pairs(Dataset):
    def __init__(self, x, y, noise):
        self.x, self.y, self.noise = x, y, noise

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        x = self.x[i]
        if self.noise:
            x = x + 0.1 * (torch.rand(()) + random.random() + float(np.random.rand()))
        return x, self.y[i]


class Stream(IterableDataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __iter__(self):
        yield from zip(self.x, self.y, strict=True)


class Float64Dataset(Task):
    name = "float64ds"
    Params = Params
    metric = "mae"

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1)).double()

    def data(self):
        g = torch.Generator().manual_seed(3)
        x = torch.randn(self.params.samples, 5, generator=g, dtype=torch.float64)
        y = x.sum(dim=1, keepdim=True).sin()
        # 77 of 96 to train on: batches of 19 end with one sample
        cut = self.params.samples - round(0.2 * self.params.samples)
        if self.params.kind == "stream":
            return Stream(x[:cut], y[:cut]), Stream(x[cut:], y[cut:])
        if self.params.kind == "pair":
            return Pairs(x[:cut], y[:cut], self.params.noise), Pairs(x[cut:], y[cut:], False)
        return Pairs(x, y, self.params.noise)

    def loss(self, output, target):
        return F.mse_loss(output, target)

    def metrics(self, output, target):
        return {"mae": (output - target).abs().mean()}
