"""A layer only some samples reach, under fsdp: found before it can make the ranks' collectives differ.

FSDP gathers a unit's parameters (an all-gather) as its forward begins and reduce-scatters the gradients
its backward gave, collectives every rank must enter in the same order with the same tensors. A forward
whose path depends on the data (``if (x > 0).any(): h = self.extra(h)``, a mixture whose experts only
some samples pick) runs a unit on one rank and skips it on another; a layer whose output the loss uses
only for some samples leaves its parameters without a gradient on some ranks. Either way one rank's
collective meets a different one on the next rank, and Gloo aborts the process (``EnforceNotMet``,
SIGABRT) or NCCL moves the wrong bytes. ddp, replicate and persistent train such a model exactly (ddp
finds the parameters each rank reaches, engine/distributed/).

Two checks refuse it in one line naming the feature and the strategies that train it:

- **before the launch** (``check_shards``, with the fit check: engine/plan/fit.py): the run's model, as
  every rank builds it, runs each rank's shard of the run's first micro-batches and its loss (no
  backward); the units each shard's forward calls, and the parameters each shard's loss reaches, are
  compared;
- **at each process's first steps** (``UnitGuard``): before each unit's forward (before its all-gather)
  and at the forward's end, the ranks agree on which unit comes next with one small all-reduce, and
  before each backward on which parameters its loss reaches; where they differ, every rank raises
  ``UnitMismatch`` there, before any collective has gone astray. Each agreement costs a round trip, so
  it watches only the first ``REACH_STEPS`` steps; a model whose ranks first part ways later still
  meets torch's own failure there (docs/fsdp.md).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from multilane.engine.errors import UserError
from multilane.engine.parallel import chunk_sizes
from torch import nn

REACH_STEPS = 4
"""The run's first optimizer steps whose micro-batches both checks watch."""

END = -1  # the forward's end, where a rank that skipped the last units arrives


DOUBLE_BACKWARD = (
    "devices.strategy = fsdp cannot train this model: its forward takes a gradient with create_graph=True (a "
    "gradient penalty), whose second backward reads parameters FSDP has already freed; train it with "
    'devices.strategy = "ddp", "replicate" or "persistent"'
)


def reached(loss: torch.Tensor) -> set[int]:
    """The ids of the leaf tensors (parameters) that ``loss``'s backward reaches."""
    seen: set[Any] = set()
    out: set[int] = set()
    stack = [loss.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        var = getattr(fn, "variable", None)
        if var is not None:
            out.add(id(var))
        stack.extend(f for f, _ in fn.next_functions)
    return out


@contextlib.contextmanager
def no_double_backward() -> Iterator[None]:
    """``UserError`` (``DOUBLE_BACKWARD``) where the code inside asks ``torch.autograd.grad`` for
    ``create_graph=True``: under fsdp that graph's backward meets freed parameters (torch's "setStorage:
    ... out of bounds for storage of size 0"), so the check's forward and a rank's first steps refuse it."""
    real = torch.autograd.grad

    def grad(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("create_graph") or (len(args) > 4 and args[4]):
            raise UserError(DOUBLE_BACKWARD)
        return real(*args, **kwargs)

    torch.autograd.grad = grad
    try:
        yield
    finally:
        torch.autograd.grad = real


class UnitMismatch(RuntimeError):
    """The ranks' forwards ran different FSDP units, or reached different parameters: their collectives
    would not match."""


def refusal(what: str, ran: int, skipped: int, where: str) -> str:
    """The one line that refuses a model whose ranks run different units (``what``: "'extra' runs on")."""
    prep = what.rsplit(" ", 1)[-1]
    return (
        f"devices.strategy = fsdp cannot train this model: a layer only some samples reach ({what} rank {ran}'s "
        f"shard {where} but not {prep} rank {skipped}'s), and FSDP gathers each layer's parameters and reduces their "
        'gradients with collectives every rank must enter alike; train it with devices.strategy = "ddp", '
        '"replicate" or "persistent"'
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


def parted_param(marks: list[list[int]]) -> tuple[int, int, int] | None:
    """(parameter, a rank whose loss reaches it, one whose loss does not), from each rank's 0/1 marks."""
    for j in range(len(marks[0])):
        column = [m[j] for m in marks]
        if len(set(column)) > 1:
            return j, column.index(1), column.index(0)
    return None


def check_shards(
    config: Any, task: Any, units_of: Callable[[nn.Module], list[nn.Module]], n: int, device: torch.device
) -> None:
    """``UserError`` (``refusal``) when the ranks' shards of the run's first micro-batches run different
    units or reach different parameters; ``units_of`` gives the model's FSDP units (units.py
    ``choose_units``); the model runs on ``device`` (the first rank's), as a rank builds it (the run's seed),
    one shard at a time."""
    from multilane.engine.data.loader import build_loader

    torch.manual_seed(config.train.seed)
    model = task.build_model().to(device)
    units = units_of(model)
    names = _names(model, units)
    params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    cfg = config.model_copy(deep=True)
    cfg.data.workers = 0
    loader = build_loader(task, cfg, device if device.type == "cuda" else None)
    micro = REACH_STEPS * config.train.grad_accum
    weights = config.devices.weights or None
    try:
        loader.start(0, micro)
        for m in range(micro):
            inputs, target, size = loader.next()
            where = f"of micro-batch {m + 1}"
            edges = [0]
            for s in chunk_sizes(size, n, weights):
                edges.append(edges[-1] + s)
            shards = [(r, a, b) for r, (a, b) in enumerate(itertools.pairwise(edges)) if b > a]
            calls, marks = [], []
            for _, a, b in shards:
                seen, mark = _shard_reach(model, units, params, task, _rows(inputs, a, b), _rows(target, a, b))
                calls.append(seen)
                marks.append(mark)
            ranks = [r for r, _, _ in shards]
            found = first_difference(calls) if len(calls) > 1 else None
            if found is not None:
                unit, x, y = found
                raise UserError(refusal(f"'{names[unit]}' runs on", ranks[x], ranks[y], where))
            param = parted_param(marks) if len(marks) > 1 else None
            if param is not None:
                j, x, y = param
                raise UserError(refusal(f"'{params[j][0]}' gets a gradient from", ranks[x], ranks[y], where))
    finally:
        loader.close()


def _shard_reach(model: nn.Module, units: list[nn.Module], params: list, task: Any, x: Any, y: Any) -> tuple:
    """The units one shard's forward calls and, for each parameter, whether its loss reaches it (1 or 0)."""
    from multilane.engine.parallel.lane_loss import model_args

    args, kwargs = model_args(x)
    with recording(units) as seen, no_double_backward():
        out = model(*args, **kwargs)
        loss = task.loss(out, y)
    ids = reached(loss)
    return list(seen), [int(id(p) in ids) for _, p in params]


def _rows(batch: Any, at: int, end: int) -> Any:
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t[at:end] if isinstance(t, torch.Tensor) and t.dim() > 0 else t, batch)


class UnitGuard:
    """Watches the units' order and the parameters each loss reaches across the ranks, in the forwards and
    backwards of the steps it is ``active`` in (see the module docstring)."""

    def __init__(self, model: nn.Module, units: list[nn.Module], group: Any = None) -> None:
        self.group = group
        self.modules = [*units, model]  # the root holds what no unit does
        self.names = _names(model, self.modules)
        self.param_names = [[f"{n}.{p}" if n != "(root)" else p for p, _ in m.named_parameters()] for n, m in
                            zip(self.names, self.modules, strict=True)]  # fmt: skip
        self.active = False
        self._forward = False
        self._live: dict[int, list[int]] = {}  # each module's parameters as its forward held them (unsharded)
        self._handles = [
            model.register_forward_pre_hook(self._begin, prepend=True),
            model.register_forward_hook(self._end),
            *(u.register_forward_pre_hook(lambda *_, i=i: self._agree(i), prepend=True) for i, u in enumerate(units)),
            *(m.register_forward_pre_hook(lambda m, _, k=k: self._hold(k, m)) for k, m in enumerate(self.modules)),
        ]

    def _begin(self, *_: Any) -> None:
        self._forward = self.active  # not an activation-checkpointing recompute in backward
        if self.active:
            self._live = {}

    def _hold(self, k: int, module: nn.Module) -> None:
        if self._forward:  # after FSDP's own pre-forward: the module holds its gathered parameters
            self._live.setdefault(k, [id(p) for p in module.parameters()])

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
        raise UnitMismatch(refusal(f"'{self.names[first]}' runs on", ran, skipped, "of this step"))

    def before_backward(self, loss: torch.Tensor) -> None:
        """Before a backward of an active step: the ranks agree on the parameters ``loss`` reaches."""
        if not self.active:
            return
        ids = reached(loss)
        mine = [
            int(i in ids) for k in range(len(self.modules)) for i in self._live.get(k, [0] * len(self.param_names[k]))
        ]
        flags = torch.tensor(mine + [1 - m for m in mine], dtype=torch.int8)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        if not bool((flags[: len(mine)] & flags[len(mine) :]).any()):
            return
        everyone: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, mine, group=self.group)
        j, ran, skipped = parted_param(everyone) or (0, 0, 0)
        name = [n for names in self.param_names for n in names][j]
        raise UnitMismatch(refusal(f"'{name}' gets a gradient from", ran, skipped, "of this step"))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
