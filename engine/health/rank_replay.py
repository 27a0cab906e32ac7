"""Where a NaN began, under ddp: every rank replays the log window together, each its own shard.

The same replay as nan_origin.py's, made for one process per device. ``RankKeeper`` keeps, at each log
window's start, what this rank needs to run the window again: the model's and the optimizer's state
(the same on every rank), the scaler, and this rank's own random streams — no collective, so steps that
stay finite pay only the copy. When the loss went non-finite (every rank sees the same gathered
record, so every rank calls ``find_rank_origin`` at the same step), each rank puts its kept state back,
reads its shards of the window's micro-batches again and replays the steps through DDP (the
gradients' all-reduce included) with the same hooks (``Tracer``) on its module; after each replayed
step the ranks gather their findings (one small collective) and all pick the same origin by the
single-process rule, ranks standing for lanes. Afterwards each rank's state is put back as it was.

Under fsdp the same, with each rank's own shards: the kept state is this rank's shards of the model and
the optimizer (1/N of them, a DTensor copy: no collective), the weights' check adds the ranks' findings,
and the gradient hooks sit on each unit's unsharded parameters, whose gradient is this rank's own
before the reduce-scatter (``unsharded_params``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from multilane.engine.health.layers import local
from multilane.engine.health.nan_origin import (
    Finding,
    Kept,
    Origin,
    StepKeeper,
    Tracer,
    origin_of,
    restore,
    snapshot,
    weights_origin,
)
from multilane.engine.parallel.replicas.lane_rng import _generators
from torch import nn

if TYPE_CHECKING:
    from multilane.engine.run.trainer import Trainer as DdpTrainer


def _streams(t: DdpTrainer) -> list[torch.Generator]:
    return _generators(t.spread.info.device.torch_device())


def rank_snapshot(t: DdpTrainer, into: Kept | None = None) -> Kept:
    """This rank's state before a log window: its own random streams (no collective)."""
    return snapshot(t, into, lane_rng=[g.get_state() for g in _streams(t)])


def rank_restore(t: DdpTrainer, k: Kept) -> None:
    def put(states: list[torch.Tensor]) -> None:
        for g, s in zip(_streams(t), states, strict=False):
            g.set_state(s)

    restore(t, k, put)


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


def _bad_weights(t: DdpTrainer, kept: Kept) -> list[str]:
    """The kept weights that are not finite on any rank (fsdp: each rank holds its own shards; one small
    collective), in the model's order."""
    mine = [n for n, v in kept.model.items() if v.is_floating_point() and not bool(torch.isfinite(local(v)).all())]
    everyone: list[Any] = [None] * t.spread.info.world
    dist.all_gather_object(everyone, mine, group=t.spread.control_group)
    return [n for n in kept.model if any(n in e for e in everyone)]


class RankKeeper(StepKeeper):
    def keep(self, t: Any) -> None:
        self.kept = rank_snapshot(t, self.kept)


class _Gathered:
    """Every rank's findings of one replayed step, as one tracer of lanes (a rank is a lane)."""

    def __init__(self, per_rank: list[dict[str, Finding | None]]) -> None:
        def of(kind: str) -> dict[int, Finding]:
            out = {}
            for rank, found in enumerate(per_rank):
                f = found[kind]
                if f is not None:
                    f.lane = rank
                    out[rank] = f
            return out

        self.inputs, self.outputs, self.grads = of("input"), of("output"), of("grad")


def find_rank_origin(t: DdpTrainer, kept: Kept, last_step: int) -> Origin | None:
    """Every rank: replay steps ``kept.step + 1`` to ``last_step`` with hooks, together; the first step
    where a non-finite value shows on any rank (the same answer on every rank), or None."""
    names = t.lane_names
    bad = weights_origin(kept, names[0], _bad_weights(t, kept))  # the same answer on every rank
    if bad is not None:
        return bad
    now = rank_snapshot(t)
    saved = (t.loader, t.window, t.health.every, t.timer)
    window = type(t.window)  # fsdp's reads the DTensor norm of its clipping
    accum = t.config.train.grad_accum
    ranks = t.spread  # the rank strategy hands the replay its loader and its log window's reduction
    combine = type(t.window).combine
    loader = ranks.rank_loader(t)
    try:
        rank_restore(t, kept)
        loader.start(kept.step * accum, last_step * accum)
        t.loader, t.health.every = loader, 0
        for step in range(kept.step + 1, last_step + 1):
            t.window = window()
            tracer = Tracer(t.model, [], single=True)
            tracer.watch_named(unsharded_params(t.model), 0)  # fsdp: this rank's gradient (ddp: none)
            try:
                t._train_step(accum)
            finally:
                tracer.remove()
            t.step = step
            mine = {
                "window": t.window.take(),
                "input": tracer.inputs.get(0),
                "output": tracer.outputs.get(0),
                "grad": tracer.grads.get(0),
            }
            everyone: list[Any] = [None] * ranks.info.world
            dist.all_gather_object(everyone, mine, group=ranks.control_group)
            windows = [e["window"] for e in everyone]
            rec = combine(windows, names, step=step) if all(w is not None for w in windows) else None
            origin = origin_of(t, step, _Gathered(everyone), rec, accum, kept.step, names)
            if origin is not None:
                return origin
        return None
    finally:
        loader.close()
        t.loader, t.window, t.health.every, t.timer = saved
        rank_restore(t, now)
