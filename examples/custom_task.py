"""An example of your own task: train it with

    multilane train --task examples/custom_task.py --devices cpu:0,cpu:1 --steps 200

A task file defines one subclass of ``multilane.engine.tasks.Task`` (or names one with ``TASK = ...``).
"""

import torch
from multilane.engine.tasks import ArrayData, Task
from pydantic import BaseModel, Field
from torch import nn
from torch.nn import functional as F


class SineParams(BaseModel):
    hidden: int = Field(32, ge=1, le=4096, description="Width of the hidden layers")
    samples: int = Field(2000, ge=10, description="Number of (x, sin x) samples")


class SineTask(Task):
    """Fit y = sin(x) on [-3, 3] with a small MLP."""

    name = "sine"
    description = "Fit sin(x) with a small MLP"
    Params = SineParams  # the task's own hyperparameters: --set task.params.hidden=64
    metric = "mae"

    def build_model(self) -> nn.Module:
        h = self.params.hidden
        return nn.Sequential(nn.Linear(1, h), nn.Tanh(), nn.Linear(h, h), nn.Tanh(), nn.Linear(h, 1))

    def data(self) -> ArrayData:
        g = torch.Generator().manual_seed(0)
        x = torch.rand(self.params.samples, 1, generator=g) * 6 - 3
        return ArrayData(inputs=x, target=torch.sin(x))

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output, target)  # a mean: the engine weights each device's loss by its shard size

    def metrics(self, output: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"mae": (output - target).abs().mean()}
