"""Parameters and gradients as every part of the engine walks them: sparse, sharded, absent or shared.

A gradient is not always a plain strided tensor:

- **sparse** (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``): a COO tensor with no
  storage of its own (``data_ptr()`` and ``untyped_storage()`` raise), uncoalesced (an index may appear
  once per lookup), which ``torch._foreach_norm`` and ``clip_grad_norm_`` do not take, and to which
  a dense tensor cannot be added in place (``sparse.add_(dense)`` raises; ``dense.add_(sparse)`` works);
- **sharded** (fsdp): a DTensor, whose local shard is this rank's part (``local``);
- **absent** (``None``): a parameter no sample reached, or a frozen one;
- **shared** (tied weights): one tensor listed under two modules; ``model.parameters()`` yields it
  once, and anything that counts bytes by storage must count it once.

Every walker uses these helpers instead of assuming a dense tensor: norms (``norms``,
``squared_norm``), bytes (``tensor_bytes``), the sum of two gradients (``add_grad``), clipping
(``clip_grad_norm``), and the modules that make sparse gradients (``sparse_grad_modules``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

_STRIDED = torch.strided


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's own part of ``t``: a DTensor's local shard (no collective), any other tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def is_sparse(t: torch.Tensor | None) -> bool:
    """Whether ``t`` is a sparse tensor (COO or compressed), not a dense one, a DTensor or None."""
    return t is not None and t.layout != torch.strided and not hasattr(t, "to_local")


def dense_part(t: torch.Tensor) -> torch.Tensor:
    """A strided tensor whose elements' squares sum to ``|t|²``: a sparse tensor's coalesced values
    (an index looked up twice holds the sum of its two rows), a DTensor's local shard, else ``t``."""
    t = local(t)
    if t.layout == torch.sparse_coo:
        return t.coalesce().values()
    if t.layout != torch.strided:  # CSR and the other compressed layouts: their values hold no duplicates
        return t.values()
    return t


def norms(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The 2-norm of each of ``tensors`` (detached), one ``_foreach_norm`` over the dense ones."""
    parts = [dense_part(t.detach()) for t in tensors]
    return list(torch._foreach_norm(parts)) if parts else []


def squared_norm(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``Σ |t|²`` over ``tensors`` as a float64 0-dim tensor on ``device`` (no sync)."""
    if not tensors:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack([n.to(device, torch.float64) for n in norms(tensors)]).square().sum()


def _parts(t: torch.Tensor) -> list[torch.Tensor]:
    """The strided tensors that hold ``t``'s bytes."""
    t = local(t)
    if t.layout == torch.sparse_coo:
        return [t._indices(), t._values()]
    if t.layout != torch.strided:  # CSR, CSC, BSR, BSC: values and whichever index tensors the layout has
        parts = [t.values()]
        for name in ("crow_indices", "col_indices", "ccol_indices", "row_indices"):
            with contextlib.suppress(RuntimeError):
                parts.append(getattr(t, name)())
        return parts
    return [t]


def tensor_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct tensors among ``tensors`` (tied parameters, and views of one storage,
    counted once; a sparse tensor by its indices and values; a DTensor by its local shard)."""
    seen: set[tuple[Any, int]] = set()
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        for part in _parts(t):
            if part.numel() == 0:
                continue
            key = (part.device, part.data_ptr())
            if key in seen:
                continue
            seen.add(key)
            total += part.numel() * part.element_size()
    return total


def grad_sum(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a + b`` out of place, in any layouts (a sparse tensor plus a dense one: dense)."""
    return b + a if is_sparse(a) and not is_sparse(b) else a + b


def add_grad(p: torch.Tensor, g: torch.Tensor) -> None:
    """``p.grad += g`` in place where the layouts allow it (dense + dense, dense + sparse, sparse +
    sparse), else ``p.grad`` becomes the sum as a new tensor (sparse + dense: dense). ``g`` may live on
    another device; ``p.grad`` None takes a copy of ``g``."""
    moved = g.to(p.device)
    if p.grad is None:
        p.grad = moved.clone() if moved is g else moved
    elif is_sparse(p.grad) and not is_sparse(moved):
        p.grad = moved + p.grad
    else:
        p.grad.add_(moved)


def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip the gradients of ``params`` to a total 2-norm of ``max_norm``; returns the norm before.

    torch's ``clip_grad_norm_`` where every gradient is dense or a DTensor (its result, bit for bit);
    with a sparse gradient among them, the same arithmetic (norm of the per-tensor norms, the factor
    ``max_norm / (norm + 1e-6)`` clamped to 1) on the coalesced values, which torch's refuses."""
    params = list(params)
    grads = [p.grad for p in params if p.grad is not None]
    if not any(is_sparse(g) for g in grads):
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    if not grads:
        return torch.tensor(0.0)
    device = grads[0].device
    total = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms(grads)]))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.device))
    return total


def grad_norm(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """The gradients' total 2-norm, as ``clip_grad_norm`` returns it, clipping nothing: logged every step
    whether or not the run clips (one fused norm on the device, read at log time)."""
    params = list(params)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    first = grads[0]
    device, dtype = first.device, first.dtype
    if all(type(g) is torch.Tensor and g.layout is _STRIDED and g.dtype is dtype and g.device == device for g in grads):
        # get_total_norm's own arithmetic for one device and dtype (bit for bit), without its grouping of
        # the tensors in Python, which cost more than the norms on a small model
        with torch.no_grad():
            return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)
    if any(is_sparse(g) for g in grads):
        device = grads[0].device
        return torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms(grads)]))
    total = getattr(torch.nn.utils, "get_total_norm", None)  # torch 2.6 on
    return total(grads) if total is not None else torch.nn.utils.clip_grad_norm_(params, float("inf"))


SPARSE_KINDS = (nn.Embedding, nn.EmbeddingBag)


def sparse_grad_modules(model: nn.Module) -> list[str]:
    """The modules of ``model`` whose weight gets a sparse gradient (``Embedding``/``EmbeddingBag``
    with ``sparse=True``), as ``"name (Kind)"``."""
    return [
        f"{name or 'the model'} ({type(m).__name__}(sparse=True))"
        for name, m in model.named_modules()
        if isinstance(m, SPARSE_KINDS) and getattr(m, "sparse", False) and m.weight.requires_grad
    ]
