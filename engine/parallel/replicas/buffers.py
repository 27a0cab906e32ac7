"""What becomes of the model's buffers (BatchNorm's running statistics) after a step on several lanes.

Each replica updates its own copy of every buffer in its forward. torch's DataParallel keeps replica
0's and drops the rest, so a lane 0 that gets no samples (``devices.weights = [0, 1]``, a batch
smaller than the lane count) leaves the statistics frozen, and lane 0's shard alone decides them.

Multilane keeps the **sample-weighted mean of the active replicas' buffers**: for BatchNorm's
``running_mean`` that is exactly the running mean of the whole batch, whatever the split; the
``running_var`` is the mean of the lanes' variances (the spread between the lanes' means is not in
it: use ``devices.sync_batchnorm`` for full-batch statistics). Integer buffers (``num_batches_tracked``)
are taken from the first active replica. A buffer all replicas agree on keeps that exact value.

The model's buffer is rebound to the new tensor rather than overwritten in place: the step's graph
may still need the old one in backward (BatchNorm saves its running statistics). A buffer that
requires grad (a leaf the loss differentiates, as a parameter that is not trained) is never rebound:
backward accumulates its ``.grad`` into the model's own tensor, and it keeps ``requires_grad``. Such a
buffer cannot be changed by a forward (autograd forbids writing a leaf that requires grad), so it keeps
its value; one a forward changed anyway (under ``no_grad``) is overwritten in place.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def merge_buffers(model: nn.Module, replicas: Sequence[nn.Module], sizes: Sequence[int]) -> None:
    """Set ``model``'s buffers from the replicas that ran, weighted by their shard ``sizes``."""
    if not replicas:
        return
    total = float(sum(sizes))
    weights = [s / total for s in sizes]
    walks = [list(r.modules()) for r in replicas]
    for k, module in enumerate(model.modules()):
        if not module._buffers:
            continue
        for name, own in module._buffers.items():
            if own is None:
                continue
            values = [walk[k]._buffers[name] for walk in walks]
            set_buffer(module, name, merge_values(values, weights, own.device))


def set_buffer(module: nn.Module, name: str, merged: torch.Tensor) -> None:
    """Make ``merged`` the value of ``module``'s buffer ``name`` (see the module docstring)."""
    own = module._buffers[name]
    if own is not None and own.requires_grad:
        if not torch.equal(own.detach(), merged):
            with torch.no_grad():
                own.copy_(merged)
        return
    module._buffers[name] = merged


def merge_values(values: Sequence[torch.Tensor | None], weights: Sequence[float], device: torch.device) -> torch.Tensor:
    """The weighted mean of one buffer's values (floating point), or the first value (integers)."""
    first = values[0]
    assert first is not None
    first = first.detach().to(device)
    if len(values) == 1 or not first.is_floating_point():
        return first
    # first + Σ wᵢ·(bᵢ − first): the weighted mean, and exactly ``first`` when every replica agrees
    # (a buffer the forward does not change must not drift by rounding, step after step).
    out = first.clone()
    for w, v in zip(weights[1:], values[1:], strict=True):
        assert v is not None
        out.add_(v.detach().to(device) - first, alpha=w)
    return out
