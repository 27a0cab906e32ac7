"""Each device's memory split into parameters, gradients, optimizer state and the rest.

Counted from the tensors themselves at log time (sizes only: no device sync), per lane or rank:

- replicate: the model, its gradients and the optimizer state live on the model's device; each other
  device holds a replica of the parameters while every step runs (torch's ``replicate`` broadcasts them
  per step): its parameters are counted there, marked ``"replica": true`` ("during each step" in the
  summary), since that is what the device holds at its peak;
- persistent: lane 0 holds the model, its gradients and the optimizer state; every other lane its
  replica's parameters and gradients;
- ddp: every rank a whole copy of all three;
- fsdp: every rank its shards of all three (1/N each, plus one unit's gathered parameters while it
  computes, which is part of the rest); with CPU offload on GPUs the shards are in host memory
  (``"host": true``).

The rest is what the device's allocator holds beyond those (activations, buffers, workspaces,
communication buffers): known on GPUs (``torch.cuda.memory_allocated``), ``None`` on CPU lanes,
whose memory is the process's and shared.
"""

from __future__ import annotations

from typing import Any

import torch
from multilane.engine.tensors.grads import local as _local
from multilane.engine.tensors.grads import tensor_bytes
from torch import nn

KINDS = ("params", "grads", "optimizer")


def split(params: list[torch.Tensor], optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """Parameter, gradient and optimizer-state bytes of ``params`` (and ``optimizer``'s state)."""
    state: list[Any] = []
    if optimizer is not None:
        for s in list(optimizer.state.values()):
            state.extend(v for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return {
        "params": tensor_bytes(params),
        "grads": tensor_bytes(p.grad for p in params if p.grad is not None),
        "optimizer": tensor_bytes(state),
    }


def with_rest(parts: dict[str, dict[str, int]], devices: dict[str, torch.device]) -> dict[str, dict[str, Any]]:
    """Each lane's parts and its rest: the device's allocated bytes beyond all lanes' parts on it (GPUs)."""
    out: dict[str, dict[str, Any]] = {}
    for name, p in parts.items():
        dev = devices[name]
        rest = None
        if dev.type == "cuda":
            same = [q for n, q in parts.items() if devices[n] == dev]
            rest = max(0, torch.cuda.memory_allocated(dev) - sum(sum(q.values()) for q in same))
        out[name] = {**p, "rest": rest}
    return out


def lanes_memory(model: nn.Module, optimizer: torch.optim.Optimizer, strategy: Any, backend: Any) -> dict[str, Any]:
    """A single-process run's split, per lane (see the module docstring)."""
    names = list(backend.lane_names)
    devices = {n: d.torch_device() for n, d in zip(names, backend.devices, strict=True)}
    parts = {n: dict.fromkeys(KINDS, 0) for n in names}
    replicas = strategy.replicas() if hasattr(strategy, "replicas") else []
    home = next((n for n in names if devices[n] == backend.model_device), names[0])
    if replicas:  # persistent: lane j runs replica j (replica 0 is the model)
        for name, r in zip(names[1:], replicas[1:], strict=False):
            parts[name] = split(list(r.parameters()), None)
    elif len(names) > 1:  # replicate: every step copies the parameters to the other lanes (CPU lanes too)
        copy = {"params": tensor_bytes(model.parameters()), "grads": 0, "optimizer": 0}
        parts.update({name: dict(copy) for name in names if name != home})
    parts[home] = split(list(model.parameters()), optimizer)
    out = with_rest(parts, devices)
    if not replicas:
        for name in names:
            if name != home and out[name]["params"]:
                out[name]["replica"] = True
    return out


def rank_memory(model: nn.Module, optimizer: torch.optim.Optimizer, key: str, device: torch.device) -> dict[str, Any]:
    """One rank's split (ddp: whole copies; fsdp: its shards). Under fsdp's CPU offload on a GPU the
    three live in host memory (``"host": true``) and the device's allocated bytes are all rest."""
    params = list(model.parameters())
    out = with_rest({key: split(params, optimizer)}, {key: device})
    if device.type == "cuda" and any(_local(p).device.type == "cpu" for p in params):
        out[key] = {**out[key], "rest": torch.cuda.memory_allocated(device), "host": True}
    return out


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "?"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def summary_lines(memory: dict[str, dict[str, Any]]) -> list[str]:
    """The end-of-run summary's lines: one per device."""
    lines = []
    for name, m in memory.items():
        rest = "" if m.get("rest") is None else f" · rest {fmt_bytes(m['rest'])}"
        host = " (in host memory)" if m.get("host") else ""
        replica = " (a replica, during each step)" if m.get("replica") else ""
        lines.append(
            f"  memory {name}: params {fmt_bytes(m['params'])}{replica} · grads {fmt_bytes(m['grads'])}"
            f" · optimizer {fmt_bytes(m['optimizer'])}{host}{rest}"
        )
    return lines


def gathered_rank_memory(
    model: nn.Module, optimizer: Any, key: str, device: torch.device, world: int, group: Any
) -> dict[str, Any]:
    """Every rank's split, on every rank (a collective: one small all-gather on the CPU group)."""
    import torch.distributed as dist

    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, rank_memory(model, optimizer, key, device), group=group)
    return {k: v for part in everyone for k, v in part.items()}
