"""Map over the nested containers a batch or a model output may be (tensor, tuple, list, dict)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_asdict") and hasattr(obj, "_fields")


def scatter_tree(obj: Any, n: int, split: Callable[[torch.Tensor], Sequence[torch.Tensor]]) -> list[Any]:
    """Split every tensor in ``obj`` with ``split`` and return ``n`` containers of the same shape.

    Non-tensor leaves are shared by every chunk, as torch's own scatter does.
    """
    if isinstance(obj, torch.Tensor):
        return list(split(obj))
    if _is_namedtuple(obj):
        return [type(obj)(*parts) for parts in zip(*(scatter_tree(o, n, split) for o in obj), strict=True)]
    if isinstance(obj, tuple) and obj:
        return [tuple(parts) for parts in zip(*(scatter_tree(o, n, split) for o in obj), strict=True)]
    if isinstance(obj, list) and obj:
        return [list(parts) for parts in zip(*(scatter_tree(o, n, split) for o in obj), strict=True)]
    if isinstance(obj, dict) and obj:
        keys = list(obj)
        columns = [scatter_tree(obj[k], n, split) for k in keys]
        return [type(obj)(zip(keys, parts, strict=True)) for parts in zip(*columns, strict=True)]
    return [obj for _ in range(n)]


def gather_tree(outputs: Sequence[Any], cat: Callable[[Sequence[torch.Tensor]], torch.Tensor]) -> Any:
    """Join per-lane outputs of the same shape into one, joining tensors with ``cat``."""
    out = outputs[0]
    if isinstance(out, torch.Tensor):
        return cat(outputs)
    if out is None:
        return None
    if isinstance(out, dict):
        return type(out)((k, gather_tree([d[k] for d in outputs], cat)) for k in out)
    if _is_namedtuple(out):
        return type(out)._make(gather_tree(list(parts), cat) for parts in zip(*outputs, strict=True))
    if isinstance(out, (tuple, list)):
        return type(out)(gather_tree(list(parts), cat) for parts in zip(*outputs, strict=True))
    return out


def first_tensor(obj: Any) -> torch.Tensor | None:
    """The first tensor found in ``obj`` (to learn a batch's size and device)."""
    if isinstance(obj, torch.Tensor):
        return obj
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (tuple, list)) else ()
    for item in items:
        t = first_tensor(item)
        if t is not None:
            return t
    return None


def move_tree(obj: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Copy every tensor in ``obj`` to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=non_blocking)
    if _is_namedtuple(obj):
        return type(obj)(*(move_tree(o, device, non_blocking) for o in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(move_tree(o, device, non_blocking) for o in obj)
    if isinstance(obj, dict):
        return type(obj)((k, move_tree(v, device, non_blocking)) for k, v in obj.items())
    return obj
