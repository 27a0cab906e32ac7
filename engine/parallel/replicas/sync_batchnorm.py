"""BatchNorm with statistics over the whole batch across lanes (``devices.sync_batchnorm = true``).

Without it each replica normalizes with its own shard's mean and variance (as torch's DataParallel
does), so a model with BatchNorm trains differently on 2 lanes than on 1. ``LaneBatchNorm`` makes
it equal to full-batch training: in each lane's forward it computes its shard's count, mean and sum
of squared deviations, hands them to the other lanes (``lane_context.exchange``), and combines
them (Chan's parallel formula, stable) into the batch's mean and variance, with ordinary torch ops:
the one backward over the combined loss then carries every lane's gradient through every lane's
statistics. On GPUs another lane's statistics are copied to the lane's device with ``.to()``,
which is differentiable. Every lane updates its replica's running statistics with the same
full-batch values (unbiased variance, as BatchNorm), so the merged buffers are those values.

Outside a multi-lane call (one lane, or the model used directly) it is an ordinary BatchNorm.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from multilane.engine.parallel.replicas.lane_context import current_lane
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

_ids = itertools.count()


class SyncBatchNormError(RuntimeError):
    """Synchronized BatchNorm asked to do what it cannot (e.g. run inside activation checkpointing)."""


class LaneBatchNorm(_BatchNorm):
    """A BatchNorm of any dimension (1d, 2d, 3d) whose training statistics span all lanes of a step."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._lane_sync_id = next(_ids)  # the same in every replica: names the exchange

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        lane = current_lane()
        batch_stats = self.training or self.running_mean is None
        if lane is None or lane.size == 1 or not batch_stats:
            if batch_stats and self.__dict__.get("_synced") and torch._C._current_graph_task_id() != -1:
                # Recomputed in backward by torch.utils.checkpoint: the other lanes are gone, and their
                # statistics cannot be recomputed here. Refuse rather than return a different value.
                raise SyncBatchNormError(
                    "devices.sync_batchnorm: a BatchNorm inside torch.utils.checkpoint cannot be recomputed "
                    "with the other lanes' statistics; keep BatchNorm layers out of checkpointed regions, or "
                    "turn devices.sync_batchnorm off"
                )
            self.__dict__["_synced"] = False
            return super().forward(input)
        self.__dict__["_synced"] = True
        return self._synced_forward(input, lane)

    def _synced_forward(self, x: torch.Tensor, lane) -> torch.Tensor:
        dims = [0, *range(2, x.dim())]
        shape = [1, -1] + [1] * (x.dim() - 2)
        count = x.numel() // x.shape[1]
        # Stats in at least fp32 (BatchNorm's own kernels do the same under autocast).
        xs = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        mean = xs.mean(dims)
        m2 = (xs - mean.reshape(shape)).square().sum(dims)
        stats = lane.exchange(("batchnorm", self._lane_sync_id), (count, mean, m2))
        dev = x.device
        counts = [c for c, _, _ in stats]
        total = sum(counts)
        if total <= 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got {total} in all lanes")
        means = [m.to(dev) for _, m, _ in stats]
        full_mean = sum(c * m for c, m in zip(counts, means, strict=True)) / total
        full_m2 = sum(s.to(dev) + c * (m - full_mean).square() for (c, _, s), m in zip(stats, means, strict=True))
        var = full_m2 / total
        y = (xs - full_mean.reshape(shape)) * torch.rsqrt(var + self.eps).reshape(shape)
        if self.weight is not None:
            y = y * self.weight.reshape(shape) + self.bias.reshape(shape)
        if self.training and self.track_running_stats and self.running_mean is not None:
            self._update_running(full_mean.detach(), (full_m2 / (total - 1)).detach())
        return y.to(x.dtype)

    @torch.no_grad()
    def _update_running(self, mean: torch.Tensor, unbiased_var: torch.Tensor) -> None:
        # What _BatchNorm.forward does, with the whole batch's statistics.
        assert self.num_batches_tracked is not None
        self.num_batches_tracked.add_(1)
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
        self.running_var.mul_(1 - factor).add_(unbiased_var.to(self.running_var.dtype), alpha=factor)


def convert_sync_batchnorm(module: nn.Module, kind: type[LaneBatchNorm] = LaneBatchNorm, **attrs: Any) -> nn.Module:
    """Replace every BatchNorm (1d/2d/3d) in ``module`` with a ``kind`` (set ``attrs`` on each) holding the
    same parameters and buffers (as ``nn.SyncBatchNorm.convert_sync_batchnorm`` does); returns the module."""
    if isinstance(module, _BatchNorm) and not isinstance(module, kind):
        new = kind(module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats)
        if module.affine:
            new.weight, new.bias = module.weight, module.bias
        new.running_mean, new.running_var = module.running_mean, module.running_var
        new.num_batches_tracked = module.num_batches_tracked
        new.training = module.training
        for key, value in attrs.items():
            setattr(new, key, value)
        return new
    for name, child in module.named_children():
        new_child = convert_sync_batchnorm(child, kind, **attrs)
        if new_child is not child:
            module._modules[name] = new_child
    return module
