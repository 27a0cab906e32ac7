"""Per-layer health on a sampled step: gradient norm, weight norm, update-to-weight ratio per
parameterized module, and mean, std and fraction of exact zeros of chosen modules' outputs.

Every value is computed on the device with ``_foreach`` kernels and per-module sums (``index_add``),
and read once, at log time (``LayerSample.read``). A layer is a module with parameters of its own
(``recurse=False``), named by its path in the model; its norms are over those parameters together.

Under fsdp a parameter and its gradient are DTensors sharded on dim 0: every sum here is then over this
rank's own shard (``to_local()``: the shard without FSDP's dim-0 padding, so no element counts twice),
and the monitor adds the ranks' sums with one all-reduce at log time (monitor.py, ``sharded``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch
from multilane.engine.tensors.grads import local, norms
from torch import nn


def param_layers(model: nn.Module) -> tuple[list[str], list[int], list[nn.Parameter]]:
    """The layers (modules with parameters of their own, in ``named_modules`` order), and for every
    trainable parameter the index of its layer."""
    names: list[str] = []
    owner: list[int] = []
    params: list[nn.Parameter] = []
    for name, m in model.named_modules():
        own = [p for p in m.parameters(recurse=False) if p.requires_grad]
        if not own:
            continue
        names.append(name or type(m).__name__)
        owner += [len(names) - 1] * len(own)
        params += own
    return names, owner, params


def module_kind(m: nn.Module) -> str:
    """The module's class name; for a module ``fully_shard`` made a unit (its class becomes
    ``FSDP<Class>``, a subclass of ``FSDPModule`` and the original), the original's."""
    cls = type(m)
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        return cls.__name__
    if isinstance(m, FSDPModule):
        cls = next(c for c in cls.__mro__ if not issubclass(c, FSDPModule))
    return cls.__name__


def activation_modules(model: nn.Module, kinds: Sequence[str]) -> list[tuple[str, str]]:
    """``(path, kind)`` of every module whose class name is one of ``kinds``."""
    wanted = {k.strip() for k in kinds if k.strip()}
    return [(n, module_kind(m)) for n, m in model.named_modules() if n and module_kind(m) in wanted]


def _group_sq(norms: list[torch.Tensor], owner: torch.Tensor, n: int) -> torch.Tensor:
    """Per layer ``Σ |x|²`` (float64) from each parameter's norm."""
    sq = torch.stack([x.to(owner.device, torch.float64) for x in norms]).square()
    return torch.zeros(n, dtype=torch.float64, device=owner.device).index_add_(0, owner, sq)


class LayerSample:
    """One sampled step's per-layer values, as device tensors until ``read``."""

    def __init__(self, model: nn.Module, kinds: Sequence[str], device: torch.device, always_act: bool = False) -> None:
        """``always_act``: a sampled step's ``act`` sums exist even if no hooked output was seen (a rank
        whose shards were empty still joins the ranks' sum with zeros)."""
        self.names, owner, self.params = param_layers(model)
        self.always_act = always_act
        self.paused = False  # a forward that is not the batch's (a rank's stand-in for an empty shard)
        self.device = device
        self.owner = torch.tensor(owner, dtype=torch.long, device=device)
        self.index = {id(p): k for k, p in enumerate(self.params)}
        self.act_names = activation_modules(model, kinds)
        self._act_index = {n: k for k, (n, _) in enumerate(self.act_names)}
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.grad_sq: torch.Tensor | None = None
        self.weight_sq: torch.Tensor | None = None
        self.update_sq: torch.Tensor | None = None
        self._before: list[torch.Tensor] | None = None
        self._act: list[torch.Tensor] = []  # per hooked output: [sum, sum of squares, zeros, count]
        self._act_of: list[int] = []

    # -- gradients and weights -----------------------------------------------------------------
    def gradients(self, scale: torch.Tensor | None) -> None:
        """The layers' gradient norms (after the lanes' gradients are summed; ``scale``: fp16's loss scale)."""
        n = len(self.names)
        grads = [(k, p.grad) for k, p in enumerate(self.params) if p.grad is not None]
        if not grads or not n:
            return
        owner = self.owner[torch.tensor([k for k, _ in grads], device=self.device)]
        sq = _group_sq(norms([g for _, g in grads]), owner, n)  # sparse, DTensor: tensors/grads.py
        self.grad_sq = sq if scale is None else sq / scale.to(sq).square()

    def before_update(self) -> None:
        """Keep the weights before the optimizer step (a copy, on sampled steps only)."""
        self._before = torch._foreach_mul([local(p.detach()) for p in self.params], 1.0)

    def after_update(self) -> None:
        """The weight norms and ``|Δw|²`` of the step the optimizer just took."""
        if not self.params:
            return
        now = [local(p.detach()) for p in self.params]
        self.weight_sq = _group_sq(norms(now), self.owner, len(self.names))
        if self._before is not None:
            torch._foreach_sub_(self._before, now)
            self.update_sq = _group_sq(norms(self._before), self.owner, len(self.names))
            self._before = None

    # -- activations ----------------------------------------------------------------------------
    def hook_activations(self, replicas: Sequence[nn.Module]) -> list[Any]:
        """Forward hooks on the chosen modules of every lane's replica (removed with the handles)."""
        handles = []
        if not self._act_index:
            return handles
        for replica in replicas:
            for name, m in replica.named_modules():
                k = self._act_index.get(name)
                if k is not None:
                    handles.append(m.register_forward_hook(self._act_hook(k)))
        return handles

    def _act_hook(self, k: int):
        def hook(_module: nn.Module, _args: Any, out: Any) -> None:
            if not isinstance(out, torch.Tensor) or not out.is_floating_point() or out.numel() == 0:
                return
            if self.paused or torch._C._current_graph_task_id() != -1:
                return  # a forward recomputed inside backward (activation checkpointing): counted once already
            x = out.detach()
            n = x.numel()
            var, mean = torch.var_mean(x, correction=0)  # one pass; the lanes' sums are formed from it
            nonzero = torch.count_nonzero(x)
            row = torch.stack([mean.double() * n, (var.double() + mean.double().square()) * n, (n - nonzero).double()])
            row = torch.cat([row, row.new_full((1,), float(n))]).to(self.device)
            with self._lock:  # lanes run at once
                self._act.append(row)
                self._act_of.append(k)

        return hook

    # -- reading ----------------------------------------------------------------------------------
    def tensors(self) -> dict[str, torch.Tensor]:
        """The step's sums as device tensors (float64), still unread."""
        out: dict[str, torch.Tensor] = {}
        for key, t in (("grad_sq", self.grad_sq), ("weight_sq", self.weight_sq), ("update_sq", self.update_sq)):
            if t is not None:
                out[key] = t
        if self._act or (self.always_act and self.act_names):
            n = len(self.act_names)
            act = torch.zeros(n, 4, dtype=torch.float64, device=self.device)
            if self._act:
                idx = torch.tensor(self._act_of, dtype=torch.long, device=self.device)
                act.index_add_(0, idx, torch.stack(self._act))
            out["act"] = act
        return out


def layer_values(names: list[str], sums: dict[str, list[Any]]) -> dict[str, list[float | None]]:
    """Per-layer ``grad_norm``, ``weight_norm``, ``update_ratio`` from the read sums (host lists)."""
    out: dict[str, list[float | None]] = {}
    g, w, u = sums.get("grad_sq"), sums.get("weight_sq"), sums.get("update_sq")
    if g is not None:
        out["grad_norm"] = [x**0.5 if x == x else None for x in g]
    if w is not None:
        out["weight_norm"] = [x**0.5 if x == x else None for x in w]
        if u is not None:
            out["update_ratio"] = [(du / dw) ** 0.5 if dw > 0 else None for du, dw in zip(u, w, strict=True)]
    return out


def activation_values(act: list[list[float]] | None) -> dict[str, list[float | None]]:
    """Per hooked module kind: mean, std and fraction of exact zeros of its outputs."""
    if act is None:
        return {}
    mean, std, zero = [], [], []
    for s, s2, z, n in act:
        if n <= 0:
            mean.append(None), std.append(None), zero.append(None)
            continue
        m = s / n
        mean.append(m)
        std.append(max(s2 / n - m * m, 0.0) ** 0.5)
        zero.append(z / n)
    return {"act_mean": mean, "act_std": std, "act_zero": zero}
