"""Where a NaN began: the log window that went non-finite, replayed from the state kept before it.

Steps that stay finite pay one thing only: at the start of each log window (every ``train.log_every``
steps), and at a resume's first step when the checkpoint was saved in the middle of a window,
``snapshot`` copies the model's and the optimizer's state and the random streams (the loader's
micro-batches are a pure function of the run's seed: nothing to keep; under ddp and fsdp each rank its
own: its shards, its streams, no collective). The run detects a non-finite loss at log time, as before.
Then ``find_origin`` puts the kept state back, reads the window's micro-batches again (a resumed window:
from the resume's step on; the steps before it were finite, or the checkpoint would not have been
saved), and has the loop run its steps again (``StepReplay``: the loop's side, built by its strategy) —
same batches, same random streams, the same strategy and lanes — with hooks (tracer.py) that note, per
lane, micro-batch and in the order they ran:

- a non-finite value in the batch's inputs (the data);
- the first module whose output holds a non-finite value, and the batch rows that hold it;
- a lane whose loss is non-finite while every module output was finite (the loss function);
- the first parameter whose gradient is non-finite (in the order backward made them);

and, through the optimizer's step hooks, every layer's update ratio and weight norm (origin.py). The
first replayed step where any of these shows is the origin (origin.py says how its samples are named).
The model, the optimizer and the random streams are then put back as they were when the run noticed
(its checkpoint and a resume see the run as it was).

Under ddp and fsdp every rank replays together, each its own shard (DDP's all-reduce, FSDP's
reduce-scatter included); after each step the ranks gather their findings (one small collective) and
all pick the same origin by the single-process rule, ranks standing for lanes. Under fsdp the kept
state is this rank's shards (a DTensor copy), the weights' check adds the ranks' findings, and the
gradient hooks sit on each unit's unsharded parameters, whose gradient is this rank's own before the
reduce-scatter (``unsharded_params``).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from multilane.engine.health.origin import MAX_DETAIL, PHASES, Origin, UpdateTrail, origin_of, sample_namer
from multilane.engine.health.tracer import Cursor, Finding, Tracer
from multilane.engine.tensors.grads import local
from torch import nn

__all__ = ["Kept", "Origin", "StepReplay", "find_origin", "restore", "snapshot", "unsharded_params"]

Gather = Callable[[Any], list[Any]]
"""Every process's object, in rank order (ddp, fsdp: ``all_gather_object`` on the ranks' group)."""


class StepReplay(Protocol):
    """The loop's side of a replay: all that ``find_origin`` and ``snapshot`` ask of the loop. Each strategy
    builds its own (``Strategy.replay``); the finder never asks which one runs."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    task: Any  # its ``loss`` is traced while a step is replayed
    lane_names: list[str]  # the run's lanes (ddp, fsdp: its ranks)
    lanes: int  # the lanes this process runs (a rank: 1)
    accum: int  # micro-batches a step
    step: int  # the loop's step, read and set
    gather: Gather  # every process's object (ddp, fsdp: every rank's; one process: its own alone)

    def lane_rng(self) -> Any: ...  # the lanes' random streams (a rank's own), or None
    def set_lane_rng(self, state: Any) -> None: ...
    def replicas(self) -> list[nn.Module]: ...  # the lanes' own copies of the model (persistent), or []
    def sizes(self, batch: int) -> list[int]: ...  # each lane's share of a batch
    def loader(self) -> Any: ...  # a fresh loader of the run's micro-batches (a rank's: its shards)
    def replaying(self, loader: Any) -> AbstractContextManager[None]: ...  # the loop reads it, health is quiet
    def run_step(self, step: int, tracer: Tracer) -> Any: ...  # in a fresh log window: that window's part
    def record(self, windows: list[Any], step: int) -> dict[str, Any] | None: ...  # the step's record


@dataclass
class Kept:
    """The state before a log window's first step."""

    step: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    scaler: dict[str, Any] | None
    rng: torch.Tensor
    lane_rng: Any  # the lanes' streams (a rank's own), or None


def _copy_into(old: Any, new: Any) -> Any:
    """``new`` copied into ``old``'s tensors where they fit (no fresh memory each window: new pages cost
    the next steps more than the copy), a fresh copy where they do not (``old`` None: a deep copy).

    Every window walks the model's and the optimizer's state this way, so the common shapes take a short
    path: a plain tensor of the same shape and dtype (its device is the one it was kept on: a run's state
    does not move) and a dict of them (the optimizer's state per parameter); numbers and strings (the
    optimizer's settings) are taken as they are."""
    if isinstance(new, dict):
        prev = old if isinstance(old, dict) else _EMPTY
        out = {}
        for k, v in new.items():
            o = prev.get(k)
            if type(v) is torch.Tensor and type(o) is torch.Tensor and o.shape == v.shape and o.dtype is v.dtype:
                out[k] = o.copy_(v.detach() if v.requires_grad else v)
            else:
                out[k] = _copy_into(o, v)
        return out
    if isinstance(new, torch.Tensor):
        if (
            isinstance(old, torch.Tensor)
            and old.shape == new.shape
            and old.dtype == new.dtype
            and old.device == new.device
        ):
            return old.copy_(new.detach())
        return new.detach().clone()
    if isinstance(new, (list, tuple)):
        prev = old if isinstance(old, (list, tuple)) and len(old) == len(new) else [None] * len(new)
        return type(new)(_copy_into(a, b) for a, b in zip(prev, new, strict=True))
    if type(new) in _AS_IS:
        return new
    return copy.deepcopy(new)


_EMPTY: dict[Any, Any] = {}
_AS_IS = (int, float, bool, str, bytes, type(None))  # immutable: a copy would only rebuild them


def snapshot(loop: StepReplay, into: Kept | None = None) -> Kept:
    """The loop's state now (``into``: an earlier copy whose buffers it reuses)."""
    lane_rng = loop.lane_rng()
    return Kept(
        step=loop.step,
        model=_copy_into(into.model if into else None, loop.model.state_dict()),
        optimizer=_copy_into(into.optimizer if into else None, loop.optimizer.state_dict()),
        scaler=loop.scaler.state_dict() if loop.scaler.is_enabled() else None,
        rng=torch.get_rng_state(),
        lane_rng=_copy_into(into.lane_rng if into else None, lane_rng) if lane_rng is not None else None,
    )


def restore(loop: StepReplay, k: Kept) -> None:
    """Put ``k`` back into the loop."""
    loop.model.load_state_dict(k.model)
    loop.optimizer.load_state_dict(_copy_into(None, k.optimizer))
    if k.scaler is not None:
        loop.scaler.load_state_dict(k.scaler)
    torch.set_rng_state(k.rng)
    if k.lane_rng is not None:
        loop.set_lane_rng(_copy_into(None, k.lane_rng))
    loop.step = k.step


class Counted:
    """The replay's loader: the loader it wraps, telling ``cursor`` which global micro-batch it hands
    out (``next``: a single-process run's whole batch; ``next_shard``: a rank's shard of it)."""

    def __init__(self, base: Any, cursor: Cursor, m0: int) -> None:
        self.base, self.cursor, self._m = base, cursor, m0

    def _advance(self) -> None:
        self.cursor.m, self.cursor.empty = self._m, False
        self._m += 1

    def next(self) -> Any:
        self._advance()
        return self.base.next()

    def next_shard(self) -> Any:
        self._advance()
        shard = self.base.next_shard()
        self.cursor.empty = shard[2] == 0  # (inputs, target, n, size): a stand-in for an empty shard
        return shard

    def __getattr__(self, name: str) -> Any:
        return getattr(self.base, name)


_OWN_LOSS = object()


@contextlib.contextmanager
def _traced(task: Any, tracer: Tracer) -> Iterator[None]:
    """While a step is replayed: the task's loss function replaced by ``tracer.loss(...)``; after it, the
    loss as it was and the tracer's hooks removed."""
    own = task.__dict__.get("loss", _OWN_LOSS)
    task.loss = tracer.loss(task.loss)
    try:
        yield
    finally:
        tracer.remove()
        if own is _OWN_LOSS:
            del task.loss
        else:
            task.loss = own


def find_origin(loop: StepReplay, kept: Kept, last_step: int) -> Origin | None:
    """Replay steps ``kept.step + 1`` to ``last_step`` of ``loop`` with hooks (every rank together, each
    its own shard); the first step where a non-finite value shows (the same answer on every rank), or
    None (the replay stayed finite: not reproducible). The loop's state is put back as it was when called."""
    names, m0 = loop.lane_names, kept.step * loop.accum
    bad = weights_origin(kept, names[0], loop.gather)
    if bad is not None:
        return bad
    now = snapshot(loop)
    loader = loop.loader()
    cursor = Cursor(m0)
    trail = UpdateTrail(loop.model, loop.optimizer)
    sharded = bool(unsharded_params(loop.model))
    try:
        restore(loop, kept)
        loader.start(m0, last_step * loop.accum)
        counted = Counted(loader, cursor, m0)
        samples = sample_namer(counted, loop.sizes)
        steps: list[Any] = []
        history: dict[int, Any] = {}  # each replayed step's rows' peaks (origin.py, rule 4)
        with loop.replaying(counted):
            for step in range(kept.step + 1, last_step + 1):
                tracer = Tracer(loop.model, loop.replicas(), single=loop.lanes == 1, cursor=cursor)
                tracer.watch_named(unsharded_params(loop.model), 0)  # fsdp: this rank's gradient
                trail.step = step
                with _traced(loop.task, tracer):
                    part = loop.run_step(step, tracer)
                # every process's findings (ddp, fsdp: one small collective), a process's lanes the run's
                everyone = loop.gather(_mine(part, tracer, trail))
                rec = loop.record([e["window"] for e in everyone], step)
                steps += _updates(everyone, sharded)
                found = _Gathered(everyone, loop.lanes)
                origin = origin_of(samples, step, found, rec, kept.step, names, steps, trail.names, history)
                if origin is not None:
                    return origin
                history[step] = found.peaks
        return None
    finally:
        trail.remove()
        loader.close()
        restore(loop, now)


def weights_origin(kept: Kept, device: str, gather: Gather) -> Origin | None:
    """The weights the replay would start from, already non-finite (an earlier update made them so; fsdp:
    on any rank, each holding its own shards), or None; the same answer on every rank."""
    everyone = gather(
        [n for n, v in kept.model.items() if v.is_floating_point() and not torch.isfinite(local(v)).all()]
    )
    bad = [n for n in kept.model if any(n in e for e in everyone)]
    if not bad:
        return None
    detail = {"step": kept.step + 1, "weights": bad[:MAX_DETAIL]}
    return Origin(kept.step + 1, "weights", bad[0], device, [], None, None, detail)


def unsharded_params(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """fsdp: each parameter's unsharded tensor (named as the parameter), whose gradient is this rank's
    own before the reduce-scatter; FSDP2 makes it at a unit's first all-gather and keeps it (its storage
    freed between uses). Empty for a model that FSDP does not shard."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = []
    for m in model.modules():
        state = m._get_fsdp_state() if hasattr(m, "_get_fsdp_state") else None
        groups = getattr(state, "_fsdp_param_groups", None)  # torch 2.13; earlier: one group
        if groups is None:
            groups = [g for g in [getattr(state, "_fsdp_param_group", None)] if g is not None]
        for group in groups:
            for fp in group.fsdp_params:
                name, unsharded = names.get(id(fp.sharded_param)), getattr(fp, "_unsharded_param", None)
                if name is not None and unsharded is not None:
                    out.append((name, unsharded))
    return out


class _Gathered:
    """Every process's findings of one replayed step, as one tracer of the run's lanes (a process's lane
    ``i`` is the run's ``process * lanes + i``; under ddp and fsdp a rank is a lane)."""

    def __init__(self, everyone: list[dict[str, Any]], lanes: int) -> None:
        def of(kind: str) -> dict[int, Finding]:
            out = {}
            for p, found in enumerate(everyone):
                for lane, f in found[kind].items():
                    f.lane = p * lanes + lane
                    out[f.lane] = f
            return out

        self.inputs, self.outputs, self.losses, self.grads = (of(kind) for kind in PHASES)
        self.peaks: dict[tuple[int, str], dict[int, Any]] = {}
        for p, found in enumerate(everyone):
            for key, lane, values in found["peaks"]:
                self.peaks.setdefault(key, {})[p * lanes + lane] = values


def _mine(window: Any, tracer: Tracer, trail: UpdateTrail) -> dict[str, Any]:
    """This process's findings of a replayed step, as plain data to gather: its window's part, each lane's
    first non-finite input, output, loss and gradient, its rows' peaks (one transfer) and its layers'
    update sums."""
    keys = [(k, lane) for k, by_lane in tracer.peaks.items() for lane in by_lane]
    flat = [tracer.peaks[k][lane] for k, lane in keys]
    one = torch.cat([v.to(flat[0].device) for v in flat]).cpu() if flat else None  # one transfer (lanes: GPUs)
    values = one.split([v.numel() for v in flat]) if one is not None else []
    peaks = [(k, lane, v.tolist()) for (k, lane), v in zip(keys, values, strict=True)]
    found = (tracer.inputs, tracer.outputs, tracer.losses, tracer.grads)
    return {"window": window, **dict(zip(PHASES, found, strict=True)), "peaks": peaks, "updates": trail.take()}


def _updates(everyone: list[dict[str, Any]], sharded: bool) -> list[tuple[int, list[list[float]]]]:
    """The step's per-layer update sums: under fsdp summed over the ranks' shards, under ddp rank 0's
    (every rank holds the same weights)."""
    if not sharded:
        return everyone[0]["updates"]
    out = []
    for parts in zip(*[e["updates"] for e in everyone], strict=True):
        rows = [v for _, v in parts]
        out.append((parts[0][0], [[sum(x) for x in zip(*r, strict=True)] for r in zip(*rows, strict=True)]))
    return out
