"""Map over the nested containers a batch or a model output may be (tensor, tuple, list, dict)."""

from __future__ import annotations

import copy
import dataclasses
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


class GatherError(TypeError):
    """A model output that cannot be joined across lanes."""


_CONSTANTS = (bool, int, float, complex, str, bytes, torch.dtype, torch.device)


def gather_tree(
    outputs: Sequence[Any], cat: Callable[[Sequence[torch.Tensor]], torch.Tensor], path: str = "output"
) -> Any:
    """Join per-lane outputs of the same structure into one, joining tensors with ``cat`` (along dim 0).

    Tensors are joined (a 0-dim tensor per lane becomes a vector with one entry per lane, as torch's
    gather does); tuples, lists, dicts, namedtuples and dataclasses are joined field by field; ``None``
    and plain constants (numbers, strings) are kept when every lane returned the same one. Anything else
    raises ``GatherError`` naming its type and where it sits: no lane's value is ever dropped.
    """
    out = outputs[0]
    if isinstance(out, torch.Tensor):
        if not all(isinstance(o, torch.Tensor) for o in outputs):
            raise GatherError(f"{path}: a tensor on some lanes but not on others")
        if out.dim() == 0:
            outputs = [o.reshape(1) for o in outputs]
        return cat(outputs)
    kinds = {type(o) for o in outputs}
    if len(kinds) > 1:
        names = ", ".join(sorted(k.__qualname__ for k in kinds))
        raise GatherError(f"{path}: lanes returned different types ({names})")
    if out is None:
        return None
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        joined = copy.copy(out)
        for f in dataclasses.fields(out):
            value = gather_tree([getattr(o, f.name) for o in outputs], cat, f"{path}.{f.name}")
            object.__setattr__(joined, f.name, value)  # frozen dataclasses too
        return joined
    if isinstance(out, dict):
        keys = list(out)
        if any(list(o) != keys for o in outputs):
            raise GatherError(f"{path}: lanes returned dicts with different keys")
        return type(out)((k, gather_tree([o[k] for o in outputs], cat, f"{path}[{k!r}]")) for k in keys)
    if isinstance(out, (tuple, list)):
        if any(len(o) != len(out) for o in outputs):
            raise GatherError(f"{path}: lanes returned {type(out).__name__}s of different lengths")
        parts = [gather_tree(list(p), cat, f"{path}[{i}]") for i, p in enumerate(zip(*outputs, strict=True))]
        return type(out)._make(parts) if _is_namedtuple(out) else type(out)(parts)
    if isinstance(out, _CONSTANTS):
        if all(o == out for o in outputs):
            return out
        raise GatherError(
            f"{path}: a {type(out).__name__} that differs between lanes cannot be gathered; return it as a tensor"
        )
    raise GatherError(
        f"{path}: cannot gather a {type(out).__qualname__} across lanes; return tensors, or tuples, lists, "
        "dicts, namedtuples or dataclasses of tensors"
    )


def first_tensor(obj: Any) -> torch.Tensor | None:
    """The first tensor found in ``obj`` (to learn a batch's size and device)."""
    if isinstance(obj, torch.Tensor):
        return obj
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
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
