"""True replicas: each lane gets its own copy of every parameter, on either backend.

torch's ``replicate`` gives replica 0 views of the original parameters and hides every replica's
parameters from ``.parameters()``. Here every lane, lane 0 included, holds its own differentiable tensor
for each parameter, in the replica's ``_parameters``, so a forward that reads ``self.parameters()`` (an L2
penalty) sees its own lane's tensors on every lane. A model that changes a parameter in place during
forward gets private copies on every lane (so a lane changes only its own copy, and no two lane threads
ever write one tensor); a model known not to (``share``) gets views on the lanes that sit on the
parameters' own device, which cost no copy of the data.
Gradients flow back into the original parameters: ``LaneCopies``' backward sums the lanes' gradients in
lane order (deterministic), and leaves a parameter that no lane used without a gradient (``None``, as on
one device; torch's ``Broadcast`` would give it zeros, which Adam and momentum do not ignore).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from multilane.engine.tensors.grads import grad_sum
from torch import nn
from torch.autograd import Function


class LaneCopies(Function):
    """``apply(devices, shared, *tensors)``: one copy of every tensor per device (lane), lane-major; a
    lane whose ``shared`` flag is set gets views of the tensors instead (no copy of the data).

    Views and copies go through this one function so that the lanes' gradients are always summed in
    the same order: a run whose first step copies and later steps view (and a resumed run, which copies
    again at its first step) stays bitwise equal to a straight run on any number of lanes."""

    @staticmethod
    def forward(
        ctx: Any, devices: Sequence[torch.device], shared: Sequence[bool], *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)
        ctx.n = len(tensors)
        ctx.lanes = len(devices)
        ctx.sources = [t.device for t in tensors]
        out = [
            t.view_as(t) if view else t.to(d, copy=True)
            for d, view in zip(devices, shared, strict=True)
            for t in tensors
        ]
        frozen = [o for k, o in enumerate(out) if not ctx.needs_input_grad[2 + k % ctx.n]]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return tuple(out)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        n = ctx.n
        result: list[torch.Tensor | None] = [None, None]
        for j in range(n):
            total = None
            for lane in range(ctx.lanes):  # lane order: the same sum on every run
                g = grads[lane * n + j]
                if g is None:
                    continue
                g = g.to(ctx.sources[j])
                total = g if total is None else grad_sum(total, g)  # sparse + dense: dense
            result.append(total)
        return tuple(result)


def is_lane_copies(node: object) -> bool:
    """Whether an autograd node is ``LaneCopies``' backward: the sum of every lane's gradients."""
    return getattr(node, "_forward_cls", None) is LaneCopies


class ReplicaSet(list):
    """The replicas (a list of modules, one per lane) and each one's parameter tensors, in the order of
    ``model.parameters()``."""

    params: list[list[torch.Tensor]]


def replicate_module(
    model: nn.Module,
    devices: Sequence[torch.device],
    detach: bool,
    buffer_owner: int | None,
    share: bool = False,
) -> ReplicaSet:
    """One true replica of ``model`` per entry of ``devices`` (see the module docstring).

    ``share``: lanes on the parameters' own device get a view of each original parameter (its own
    tensor object, differentiable, no copy of the data) instead of a copy. Only for a model known not
    to change its parameters in forward: a view shares the original's version counter, so the strategy
    still notices any write (engine/parallel/replicas/inplace.py).

    Buffers: the replica at position ``buffer_owner`` holds the original buffers (torch's replicate
    semantics) and the others copies. Both backends pass None: every lane updates copies, and the step
    merges them into the model once the forward that counts is done (engine/parallel/replicas/buffers.py).
    """
    params = list(model.parameters())
    grad = not detach and torch.is_grad_enabled()
    copies: list[list[torch.Tensor]] = [[] for _ in devices]
    if params:
        home = params[0].device  # the engine moves the whole model to its first device
        shared = [share and d == home for d in devices]
        if grad:
            flat = LaneCopies.apply(list(devices), shared, *params)
            copies = [list(flat[k * len(params) : (k + 1) * len(params)]) for k in range(len(devices))]
        else:
            copies = [
                [p.detach() if view else p.detach().to(d, copy=True) for p in params]
                for d, view in zip(devices, shared, strict=True)
            ]
    plan = _Plan(model, params)
    replicas = ReplicaSet(
        plan.build(lane_params, _lane_buffers(model, d, detach, k == buffer_owner))
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


class _Plan:
    """The module tree of ``model``, walked once per replicate, then stamped out once per lane."""

    def __init__(self, model: nn.Module, params: list[torch.Tensor]) -> None:
        self.modules = list(model.modules())
        self.index = {m: i for i, m in enumerate(self.modules)}
        self.param_index = {p: i for i, p in enumerate(params)}
        # Modules that do their own thing on replication or attribute setting (RNNs cache their
        # weights in _flat_weights) take torch's slow path; the rest a plain dict copy.
        self.plain = [
            type(m)._replicate_for_data_parallel is nn.Module._replicate_for_data_parallel
            and type(m).__setattr__ is nn.Module.__setattr__
            for m in self.modules
        ]

    def build(self, lane_params: list[torch.Tensor], buffers: dict[torch.Tensor, Any]) -> nn.Module:
        copies = [
            _plain_replica(m) if plain else m._replicate_for_data_parallel()
            for m, plain in zip(self.modules, self.plain, strict=True)
        ]
        for m, r, plain in zip(self.modules, copies, self.plain, strict=True):
            for key, child in m._modules.items():
                r._modules[key] = None if child is None else copies[self.index[child]]
            for key, p in m._parameters.items():
                if p is None:
                    r._parameters[key] = None
                elif plain:
                    r._parameters[key] = lane_params[self.param_index[p]]
                else:
                    # setattr first, as torch's replicate does, so that modules caching their weights
                    # (RNNs' _flat_weights) pick up the tensor; then move it where .parameters() finds it.
                    setattr(r, key, lane_params[self.param_index[p]])
                    r._parameters[key] = r.__dict__.pop(key)
            for key, b in m._buffers.items():
                r._buffers[key] = None if b is None else buffers[b]
        return copies[0]


def _plain_replica(m: nn.Module) -> nn.Module:
    """What ``nn.Module._replicate_for_data_parallel`` does, without its per-attribute ``__setattr__``."""
    r = object.__new__(type(m))
    d = m.__dict__.copy()
    d["_parameters"] = {}
    d["_buffers"] = d["_buffers"].copy()
    d["_modules"] = d["_modules"].copy()
    d["_is_replica"] = True
    object.__setattr__(r, "__dict__", d)
    return r
