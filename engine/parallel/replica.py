"""True replicas: each lane gets its own copy of every parameter, on either backend.

torch's ``replicate`` gives replica 0 views of the original parameters and hides every replica's
parameters from ``.parameters()``. Here every lane, lane 0 included, holds a private differentiable copy
of each parameter (so a forward that changes a parameter in place changes only its own lane's copy, and
no two lane threads ever write one tensor), and the copies sit in the replica's ``_parameters``, so a
forward that reads ``self.parameters()`` (an L2 penalty) sees its own lane's copies on every lane.
Gradients flow back into the original parameters: ``LaneCopies``' backward sums the lanes' gradients in
lane order (deterministic), and leaves a parameter that no lane used without a gradient (``None``, as on
one device; torch's ``Broadcast`` would give it zeros, which Adam and momentum do not ignore).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.autograd import Function


class LaneCopies(Function):
    """``apply(devices, *tensors)``: one copy of every tensor per device (lane), lane-major."""

    @staticmethod
    def forward(ctx: Any, devices: Sequence[torch.device], *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)
        ctx.n = len(tensors)
        ctx.lanes = len(devices)
        ctx.sources = [t.device for t in tensors]
        out = [t.to(d, copy=True) for d in devices for t in tensors]
        frozen = [o for k, o in enumerate(out) if not ctx.needs_input_grad[1 + k % ctx.n]]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return tuple(out)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        n = ctx.n
        result: list[torch.Tensor | None] = [None]
        for j in range(n):
            total = None
            for lane in range(ctx.lanes):  # lane order: the same sum on every run
                g = grads[lane * n + j]
                if g is None:
                    continue
                g = g.to(ctx.sources[j])
                total = g if total is None else total + g
            result.append(total)
        return tuple(result)


class ReplicaSet(list):
    """The replicas (a list of modules, one per lane) and each one's parameter tensors, in the order of
    ``model.parameters()``."""

    params: list[list[torch.Tensor]]


def replicate_module(
    model: nn.Module, devices: Sequence[torch.device], detach: bool, buffer_owner: int | None
) -> ReplicaSet:
    """One true replica of ``model`` per entry of ``devices`` (see the module docstring).

    Buffers: the replica at position ``buffer_owner`` (the lane on the model's own device, if it takes
    part) holds the original buffers, so BatchNorm running statistics persist from it, as with torch's
    replicate; the others hold copies.
    """
    params = list(model.parameters())
    if not params:
        copies: list[list[torch.Tensor]] = [[] for _ in devices]
    elif detach or not torch.is_grad_enabled():
        copies = [[p.detach().to(d, copy=True) for p in params] for d in devices]
    else:
        flat = LaneCopies.apply(list(devices), *params)
        copies = [list(flat[k * len(params) : (k + 1) * len(params)]) for k in range(len(devices))]
    replicas = ReplicaSet(
        _build(model, params, lane_params, _lane_buffers(model, d, detach, k == buffer_owner))
        for k, (d, lane_params) in enumerate(zip(devices, copies, strict=True))
    )
    replicas.params = copies
    return replicas


def _lane_buffers(model: nn.Module, device: torch.device, detach: bool, owner: bool) -> dict[torch.Tensor, Any]:
    if owner:
        return {b: b for b in model.buffers()}
    out = {}
    for b in model.buffers():
        keep_grad = b.requires_grad and not detach and torch.is_grad_enabled()
        out[b] = b.to(device, copy=True) if keep_grad else b.detach().to(device, copy=True)
    return out


def _build(
    model: nn.Module, params: list[torch.Tensor], lane_params: list[torch.Tensor], buffers: dict[torch.Tensor, Any]
) -> nn.Module:
    modules = list(model.modules())
    index = {m: i for i, m in enumerate(modules)}
    param_index = {p: i for i, p in enumerate(params)}
    copies = [m._replicate_for_data_parallel() for m in modules]
    for m, r in zip(modules, copies, strict=True):
        for key, child in m._modules.items():
            r._modules[key] = None if child is None else copies[index[child]]
        for key, p in m._parameters.items():
            if p is None:
                r._parameters[key] = None
                continue
            # setattr first, as torch's replicate does, so that modules caching their weights (RNNs'
            # _flat_weights) pick up the copy; then move it where .parameters() finds it.
            setattr(r, key, lane_params[param_index[p]])
            r._parameters[key] = r.__dict__.pop(key)
        for key, b in m._buffers.items():
            r._buffers[key] = None if b is None else buffers[b]
    return copies[0]
