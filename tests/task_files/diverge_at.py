"""A float64 regression that goes non-finite at a chosen optimizer step, for the tests that a NaN never
reaches a checkpoint (tests/engine/run/test_diverged.py and its ddp/fsdp twins).

``at``: the step (1-based; 0: never) whose batch holds the marked samples, found from the engine's own
data order (``epoch_order`` of ``seed``, ``batch`` samples a step, one micro-batch a step, no validation
split), so the step is the same on any number of lanes or ranks. ``how``:

- ``loss``: the marked samples' inputs are NaN, so step ``at``'s loss is NaN;
- ``weights``: the marked samples' gradient is inf (``InfGrad``) while their loss stays finite, so
  step ``at``'s loss is finite but its update makes the weights non-finite (step ``at + 1``'s loss is NaN).

``marked``: how many of the step's samples are marked (the first ones: one lane or rank holds them).
"""

import math

import torch
from multilane.engine.data.order import epoch_order
from multilane.engine.tasks import ArrayData, Task
from pydantic import BaseModel
from torch import nn

F64 = torch.float64


class Params(BaseModel):
    at: int = 0
    how: str = "loss"
    seed: int = 0
    batch: int = 8
    samples: int = 96
    marked: int = 1


class InfGrad(torch.autograd.Function):
    """The identity forward; backward multiplies the gradient of the marked rows by inf."""

    @staticmethod
    def forward(ctx, h, marker):
        ctx.save_for_backward(marker)
        return h.clone()

    @staticmethod
    def backward(ctx, grad):
        (marker,) = ctx.saved_tensors
        scale = torch.where(marker > 0, math.inf, 1.0).to(grad.dtype)
        return grad * scale[:, None], None


class Marked(nn.Module):
    """Column 0 of the input marks a sample; the rest is the regression's features."""

    def __init__(self, inf_grad: bool) -> None:
        super().__init__()
        self.inf_grad = inf_grad
        self.first = nn.Linear(4, 6, dtype=F64)
        self.out = nn.Linear(6, 1, dtype=F64)

    def forward(self, x):
        h = torch.tanh(self.first(x[:, 1:]))
        if self.inf_grad:
            h = InfGrad.apply(h, x[:, 0])
        return self.out(h)


class DivergeAt(Task):
    name = "diverge_at"
    Params = Params

    def build_model(self):
        return Marked(self.params.how == "weights")

    def marked_samples(self) -> list[int]:
        """The sample indices of step ``at``'s batch that are marked."""
        p = self.params
        if p.at <= 0:
            return []
        per_epoch = math.ceil(p.samples / p.batch)
        epoch, pos = divmod(p.at - 1, per_epoch)
        order = epoch_order(p.samples, p.seed, epoch)[pos * p.batch : (pos + 1) * p.batch]
        return [int(i) for i in order[: p.marked]]

    def data(self):
        p = self.params
        g = torch.Generator().manual_seed(5)
        x = torch.randn(p.samples, 5, generator=g, dtype=F64)
        x[:, 0] = 0.0
        y = torch.randn(p.samples, 1, generator=g, dtype=F64)
        for i in self.marked_samples():
            if p.how == "loss":
                x[i, 1] = math.nan
            else:
                x[i, 0] = 1.0
        return ArrayData(x, y), None

    def loss(self, output, target):
        return nn.functional.mse_loss(output, target)
