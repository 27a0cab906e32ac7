"""A lane's loss: the task's loss (and loss weight) checked to be one number per batch, the model's
output checked to hold one row per sample, and how a batch's inputs reach the model. What every
strategy's step uses on each device: the lanes here, a ddp or fsdp rank (engine/distributed/)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from multilane.engine.parallel.tree import first_tensor


class LossNotScalarError(ValueError):
    """The task's loss returned something other than one number."""


def model_args(inputs: Any) -> tuple[tuple, dict]:
    """How a batch's inputs are passed to the model: a tensor as one argument, a tuple as positional
    arguments, a dict as keyword arguments."""
    if isinstance(inputs, dict):
        return (), inputs
    if isinstance(inputs, tuple):
        return inputs, {}
    return (inputs,), {}


class OutputShapeError(ValueError):
    """The model's output does not hold one row per input sample."""


def check_batch(output: Any, target: Any) -> None:
    """The model must return one row per sample: a wrong batch size would broadcast silently."""
    if type(output) is torch.Tensor and type(target) is torch.Tensor:  # the common case, without the walk
        out, tgt = output, target
    else:
        out, tgt = first_tensor(output), first_tensor(target)
    if out is not None and tgt is not None and out.dim() > 0 and tgt.dim() > 0 and out.shape[0] != tgt.shape[0]:
        raise OutputShapeError(
            f"the model returned {out.shape[0]} rows (shape {tuple(out.shape)}) for {tgt.shape[0]} samples"
        )


class LossWeightError(ValueError):
    """The task's loss_weight returned something other than one number >= 0."""


LossFn = Callable[[Any, Any], torch.Tensor]
WeightFn = Callable[[Any, Any], "torch.Tensor | float"]


class LaneLoss:
    """A lane's loss as a 1-element vector (fp32 at least), so that gather stacks them without a warning;
    with a ``weight_fn``, the pair ``(loss, weight)`` of such vectors."""

    def __init__(self, loss_fn: LossFn, weight_fn: WeightFn | None = None) -> None:
        self.loss_fn, self.weight_fn = loss_fn, weight_fn

    def __call__(self, output: Any, target: Any) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        check_batch(output, target)
        loss = self.check(self.loss_fn(output, target))
        if self.weight_fn is None:
            return loss.reshape(1)
        return loss.reshape(1), self.weight(self.weight_fn(output, target), loss).reshape(1)

    @staticmethod
    def check(loss: Any) -> torch.Tensor:
        """The loss as a 0-dim tensor, in fp32 at least; LossNotScalarError if it is not one number."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise LossNotScalarError(f"the loss must be one number (a 0-dim tensor), got {shape}")
        if loss.dtype in (torch.float16, torch.bfloat16):
            loss = loss.float()
        return loss if loss.dim() == 0 else loss.reshape(())

    @staticmethod
    def weight(w: Any, loss: torch.Tensor) -> torch.Tensor:
        """The loss weight as a 0-dim tensor in the loss's dtype, on its device, never differentiated."""
        if isinstance(w, torch.Tensor):
            if w.numel() != 1:
                raise LossWeightError(f"loss_weight must be one number, got shape {tuple(w.shape)}")
            return w.detach().reshape(()).to(device=loss.device, dtype=loss.dtype)
        if isinstance(w, (int, float)) and not isinstance(w, bool):
            return torch.tensor(float(w), dtype=loss.dtype, device=loss.device)
        raise LossWeightError(f"loss_weight must be a number or a 0-dim tensor, got {type(w).__name__}")
