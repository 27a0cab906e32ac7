"""A layer only some samples reach, under fsdp: found before it can make the ranks' collectives differ.

FSDP gathers a unit's parameters (an all-gather) as its forward begins and reduce-scatters its gradients
in backward, a collective every rank must enter in the same order. A forward whose path depends on the
data (``if (x > 0).any(): h = self.extra(h)``, a mixture whose experts only some samples pick) runs a
unit on one rank and skips it on another: one rank's all-gather meets another unit's on the next rank,
and Gloo aborts the process (``EnforceNotMet``, SIGABRT) or NCCL moves the wrong bytes. ddp, replicate and
persistent train such a model exactly (ddp finds the parameters each rank reaches, engine/distributed).

Two checks refuse it in one line naming the feature and the strategies that train it:

- **before the launch** (``check_shards``, with the fit check: engine/plan/fsdp_probe.py): the run's
  model, as every rank builds it, runs each rank's shard of the run's first micro-batches (no gradient),
  and the units each shard's forward calls are compared;
- **at each process's first steps** (``UnitGuard``): before each unit's forward (before its all-gather)
  and at the forward's end, the ranks agree on which unit comes next with one small all-reduce; where
  they differ, every rank raises ``UnitMismatch`` there, before any collective has gone astray. The
  agreement costs a round trip per unit, so it watches only the first ``REACH_STEPS`` steps; a model whose ranks first
  part ways later still meets torch's own failure there (docs/fsdp.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from multilane.engine.errors import UserError
from multilane.engine.parallel import chunk_sizes
from torch import nn

REACH_STEPS = 4
"""The run's first optimizer steps whose micro-batches the launch-time check runs, shard by shard."""

END = -1  # the forward's end, where a rank that skipped the last units arrives


class UnitMismatch(RuntimeError):
    """The ranks' forwards ran different FSDP units: their collectives would not match."""


def refusal(unit: str, ran: int, skipped: int, where: str) -> str:
    """The one line that refuses a model whose ranks run different units."""
    return (
        f"devices.strategy = fsdp cannot train this model: a layer only some samples reach ('{unit}' runs on "
        f"rank {ran}'s shard {where} but not on rank {skipped}'s), and FSDP gathers each layer's parameters with "
        'a collective every rank must enter; train it with devices.strategy = "ddp", "replicate" or "persistent"'
    )


def _names(model: nn.Module, units: list[nn.Module]) -> list[str]:
    by_id = {id(m): name for name, m in model.named_modules()}
    return [by_id.get(id(u), type(u).__name__) or "(root)" for u in units]


@contextlib.contextmanager
def recording(units: list[nn.Module]) -> Iterator[list[int]]:
    """The indices of the units whose forward runs in the block, in order."""
    calls: list[int] = []
    handles = [u.register_forward_pre_hook(lambda *_, i=i: calls.append(i)) for i, u in enumerate(units)]
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def first_difference(calls: list[list[int]]) -> tuple[int, int, int] | None:
    """(unit, a rank that ran it, a rank that did not) where the ranks' unit sequences first part, or None."""
    longest = max(len(c) for c in calls)
    for k in range(longest):
        at = [c[k] if k < len(c) else END for c in calls]
        if len(set(at)) > 1:
            return _parted(at)
    return None


def _parted(at: list[int]) -> tuple[int, int, int]:
    """Where each rank is (a unit, or ``END``) at the first point they differ: the unit some ranks skipped (the
    first by the units' order, the model's own, which a forward mostly follows), a rank at it, one not."""
    unit = min(u for u in at if u != END)
    return unit, at.index(unit), next(r for r, u in enumerate(at) if u != unit)


def check_shards(
    config: Any, task: Any, units_of: Callable[[nn.Module], list[nn.Module]], n: int, device: torch.device
) -> None:
    """``UserError`` (``refusal``) when the ranks' shards of the run's first micro-batches run different
    units; ``units_of`` gives the model's FSDP units (units.py ``choose_units``); the model runs on ``device``
    (the first rank's), as a rank builds it (the run's seed)."""
    from multilane.engine.data.loader import build_loader
    from multilane.engine.parallel.strategy import model_args

    torch.manual_seed(config.train.seed)
    model = task.build_model().to(device)
    units = units_of(model)
    if not units:
        return
    names = _names(model, units)
    cfg = config.model_copy(deep=True)
    cfg.data.workers = 0
    loader = build_loader(task, cfg, device if device.type == "cuda" else None)
    micro = REACH_STEPS * config.train.grad_accum
    weights = config.devices.weights or None
    try:
        loader.start(0, micro)
        for m in range(micro):
            inputs, _, size = loader.next()
            sizes = chunk_sizes(size, n, weights)
            calls = []
            at = 0
            for s in sizes:
                part = _rows(inputs, at, s)
                at += s
                with torch.no_grad(), recording(units) as seen:
                    if s > 0:
                        args, kwargs = model_args(part)
                        model(*args, **kwargs)
                calls.append(list(seen) if s > 0 else None)
            ran = [c for c in calls if c is not None]
            found = first_difference(ran) if len(ran) > 1 else None
            if found is not None:
                ranks = [r for r, c in enumerate(calls) if c is not None]
                unit, a, b = found
                raise UserError(refusal(names[unit], ranks[a], ranks[b], f"of micro-batch {m + 1}"))
    finally:
        loader.close()


def _rows(inputs: Any, at: int, size: int) -> Any:
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t[at : at + size] if isinstance(t, torch.Tensor) and t.dim() > 0 else t, inputs)


class UnitGuard:
    """Watches the units' order across the ranks during the forwards of a step (see the module docstring)."""

    def __init__(self, model: nn.Module, units: list[nn.Module], group: Any = None) -> None:
        self.units, self.group = units, group
        self.names = _names(model, units)
        self.active = False
        self._forward = False
        self._handles = [
            model.register_forward_pre_hook(self._begin, prepend=True),
            model.register_forward_hook(self._end),
            *(u.register_forward_pre_hook(lambda *_, i=i: self._agree(i), prepend=True) for i, u in enumerate(units)),
        ]

    def _begin(self, *_: Any) -> None:
        self._forward = self.active  # not an activation-checkpointing recompute in backward

    def _end(self, *_: Any) -> None:
        if self._forward:
            self._forward = False
            self._agree(END)

    def _agree(self, unit: int) -> None:
        if not self._forward:
            return
        marks = torch.tensor([unit, -unit], dtype=torch.int64)
        dist.all_reduce(marks, op=dist.ReduceOp.MAX, group=self.group)
        if int(marks[0]) == -int(marks[1]):
            return
        self._forward = False
        everyone: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, unit, group=self.group)
        first, ran, skipped = _parted(everyone)
        raise UnitMismatch(refusal(self.names[first], ran, skipped, "of this step"))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
