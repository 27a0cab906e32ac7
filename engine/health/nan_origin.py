"""Where a NaN began: the log window that went non-finite, replayed from the state kept before it.

Steps that stay finite pay one thing only: at the start of each log window (every ``train.log_every``
steps), and at a resume's first step when the checkpoint was saved in the middle of a window,
``StepKeeper.keep`` copies the model's and the optimizer's state and the random streams (the loader's
micro-batches are a pure function of the run's seed: nothing to keep). The run detects a non-finite
loss at log time, as before. Then ``find_origin`` puts the kept state back, reads the window's
micro-batches again (a resumed window: from the resume's step on; the steps before it were finite, or
the checkpoint would not have been saved), and replays its steps — same batches, same random streams,
the same strategy and lanes — with hooks (tracer.py) that note, per lane, micro-batch and in the order
they ran:

- a non-finite value in the batch's inputs (the data);
- the first module whose output holds a non-finite value, and the batch rows that hold it;
- a lane whose loss is non-finite while every module output was finite (the loss function);
- the first parameter whose gradient is non-finite (in the order backward made them);

and, through the optimizer's step hooks, every layer's update ratio and weight norm (origin.py). The
first replayed step where any of these shows is the origin (origin.py says how its samples are named).
The model, the optimizer and the random streams are then put back as they were when the run noticed
(its checkpoint and a resume see the run as it was).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from multilane.engine.health.origin import MAX_DETAIL, Origin, UpdateTrail, origin_of
from multilane.engine.health.tracer import Cursor, Finding, Tracer

if TYPE_CHECKING:
    from multilane.engine.run.trainer import Trainer

__all__ = ["Finding", "Kept", "Origin", "StepKeeper", "Tracer", "find_origin", "origin_of", "restore", "snapshot"]


def _clone(obj: Any) -> Any:
    """A deep copy whose tensors are fresh copies on their own device."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone(v) for v in obj)
    return copy.deepcopy(obj)


@dataclass
class Kept:
    """The state before a log window's first step."""

    step: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    scaler: dict[str, Any] | None
    rng: torch.Tensor
    lane_rng: dict[str, Any] | None


def _copy_into(old: Any, new: Any) -> Any:
    """``new`` copied into ``old``'s tensors where they fit (no fresh memory each window: new pages cost
    the next steps more than the copy), a fresh copy where they do not."""
    if isinstance(new, torch.Tensor):
        if (
            isinstance(old, torch.Tensor)
            and old.shape == new.shape
            and old.dtype == new.dtype
            and old.device == new.device
        ):
            return old.copy_(new.detach())
        return new.detach().clone()
    if isinstance(new, dict):
        prev = old if isinstance(old, dict) else {}
        return {k: _copy_into(prev.get(k), v) for k, v in new.items()}
    if isinstance(new, (list, tuple)):
        prev = old if isinstance(old, (list, tuple)) and len(old) == len(new) else [None] * len(new)
        return type(new)(_copy_into(a, b) for a, b in zip(prev, new, strict=True))
    return copy.deepcopy(new)


class StepKeeper:
    """Keeps the state before each log window (the only cost on steps that stay finite), in the same
    buffers from one window to the next."""

    def __init__(self) -> None:
        self.kept: Kept | None = None

    def keep(self, t: Trainer) -> None:
        self.kept = snapshot(t, self.kept)


def snapshot(t: Any, into: Kept | None = None, lane_rng: Any = None) -> Kept:
    """The trainer's state now; ``lane_rng``: the lanes' random streams (default: the strategy's)."""
    if lane_rng is None:
        random = getattr(t.strategy, "random", None)
        lane_rng = random.state_dict() if random is not None else None
    return Kept(
        step=t.step,
        model=_copy_into(into.model if into else None, t.model.state_dict()),
        optimizer=_copy_into(into.optimizer if into else None, t.optimizer.state_dict()),
        scaler=t.scaler.state_dict() if t.scaler.is_enabled() else None,
        rng=torch.get_rng_state(),
        lane_rng=_copy_into(into.lane_rng if into else None, lane_rng) if lane_rng is not None else None,
    )


def restore(t: Any, k: Kept, set_lane_rng: Any = None) -> None:
    """Put ``k`` back; ``set_lane_rng(state)`` puts the lanes' streams back (default: the strategy's)."""
    t.model.load_state_dict(k.model)
    t.optimizer.load_state_dict(_clone(k.optimizer))
    if k.scaler is not None:
        t.scaler.load_state_dict(k.scaler)
    torch.set_rng_state(k.rng)
    if set_lane_rng is None:
        random = getattr(t.strategy, "random", None)
        set_lane_rng = random.load_state_dict if random is not None else None
    if set_lane_rng is not None and k.lane_rng is not None:
        set_lane_rng(_clone(k.lane_rng))
    t.step = k.step


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


class TracedLoss:
    """The task's loss function replaced by ``tracer.loss(...)`` while a step is replayed."""

    _MISSING = object()

    def __init__(self, task: Any, tracer: Tracer) -> None:
        self.task, self.own = task, task.__dict__.get("loss", self._MISSING)
        task.loss = tracer.loss(task.loss)

    def remove(self) -> None:
        if self.own is self._MISSING:
            del self.task.loss
        else:
            self.task.loss = self.own


def find_origin(t: Trainer, kept: Kept, last_step: int) -> Origin | None:
    """Replay steps ``kept.step + 1`` to ``last_step`` of trainer ``t`` with hooks; the first step where
    a non-finite value shows, or None (the replay stayed finite: not reproducible). ``t``'s state is
    put back as it was when called."""
    bad = weights_origin(kept, t.backend.lane_names[0])
    if bad is not None:
        return bad
    now = snapshot(t)
    saved = (t.loader, t.window, t.health.every, t.strategy.lane_grads, t.timer)
    window = type(t.window)  # the loop's log window (this module is below the loop: it is handed one)
    accum = t.config.train.grad_accum
    from multilane.engine.data.loader import build_loader

    loader = build_loader(t.task, t.config, None if t.backend.model_device.type != "cuda" else t.backend.model_device)
    cursor = Cursor(kept.step * accum)
    trail = UpdateTrail(t.model, t.optimizer)
    try:
        restore(t, kept)
        loader.start(kept.step * accum, last_step * accum)
        t.loader, t.health.every = Counted(loader, cursor, kept.step * accum), 0
        steps: list[Any] = []
        history: dict[int, Any] = {}  # each replayed step's rows' peaks (origin.py, rule 4)
        for step in range(kept.step + 1, last_step + 1):
            t.window = window(t.backend.lane_names)
            t.window.resume()
            replicas = t._replicas() or []
            tracer = Tracer(t.model, replicas, single=len(t.devices) == 1, cursor=cursor)
            t.strategy.lane_grads = tracer
            loss, trail.step = TracedLoss(t.task, tracer), step
            try:
                t._train_step(accum)
            finally:
                tracer.remove()
                loss.remove()
            t.step = step
            steps += trail.take()
            rec = t.window.record(step=step)
            origin = origin_of(t, step, tracer, rec, kept.step, t.backend.lane_names, steps, trail.names, history)
            if origin is not None:
                return origin
            history[step] = tracer.peaks
        return None
    finally:
        trail.remove()
        loader.close()
        t.loader, t.window, t.health.every, t.strategy.lane_grads, t.timer = saved
        restore(t, now)


def weights_origin(kept: Kept, device: str, bad: list[str] | None = None) -> Origin | None:
    """The weights the replay would start from, already non-finite (an earlier update made them so), or None.
    ``bad``: those non-finite, where the caller found them (fsdp: over every rank's shards)."""
    if bad is None:
        bad = [n for n, v in kept.model.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if not bad:
        return None
    detail = {"step": kept.step + 1, "weights": bad[:MAX_DETAIL]}
    return Origin(kept.step + 1, "weights", bad[0], device, [], None, None, detail)
