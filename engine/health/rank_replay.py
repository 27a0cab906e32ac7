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
    Counted,
    Finding,
    Kept,
    Origin,
    StepKeeper,
    TracedLoss,
    Tracer,
    origin_of,
    restore,
    snapshot,
    weights_origin,
)
from multilane.engine.health.origin import UpdateTrail
from multilane.engine.health.tracer import Cursor
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

    def __init__(self, per_rank: list[dict[str, Any]]) -> None:
        def of(kind: str) -> dict[int, Finding]:
            out = {}
            for rank, found in enumerate(per_rank):
                f = found[kind]
                if f is not None:
                    f.lane = rank
                    out[rank] = f
            return out

        self.inputs, self.outputs, self.grads = of("input"), of("output"), of("grad")
        self.losses = of("loss")
        self.peaks: dict[tuple[int, str], dict[int, Any]] = {}
        for rank, found in enumerate(per_rank):
            for key, values in found["peaks"]:
                self.peaks.setdefault(key, {})[rank] = values


def _mine(t: Any, tracer: Tracer, trail: UpdateTrail) -> dict[str, Any]:
    """This rank's findings of a replayed step, as plain data for the ranks' gather: its window, its
    first non-finite input, output, loss and gradient, its rows' peaks and its layers' update sums."""
    keys = list(tracer.peaks)
    flat = [tracer.peaks[k][0] for k in keys if 0 in tracer.peaks[k]]
    values = torch.cat(flat).tolist() if flat else []
    peaks, at = [], 0
    for k, v in zip([k for k in keys if 0 in tracer.peaks[k]], flat, strict=True):
        peaks.append((k, values[at : at + v.numel()]))
        at += v.numel()
    return {
        "window": t.window.take(),
        "input": tracer.inputs.get(0),
        "output": tracer.outputs.get(0),
        "loss": tracer.losses.get(0),
        "grad": tracer.grads.get(0),
        "peaks": peaks,
        "updates": trail.take(),
    }


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
    cursor = Cursor(kept.step * accum)
    trail = UpdateTrail(t.model, t.optimizer)
    sharded = bool(unsharded_params(t.model))
    try:
        rank_restore(t, kept)
        loader.start(kept.step * accum, last_step * accum)
        t.loader, t.health.every = Counted(loader, cursor, kept.step * accum), 0
        steps: list[Any] = []
        history: dict[int, Any] = {}  # each replayed step's rows' peaks (origin.py, rule 4)
        for step in range(kept.step + 1, last_step + 1):
            t.window = window()
            tracer = Tracer(t.model, [], single=True, cursor=cursor)
            tracer.watch_named(unsharded_params(t.model), 0)  # fsdp: this rank's gradient (ddp: none)
            loss, trail.step = TracedLoss(t.task, tracer), step
            try:
                t._train_step(accum)
            finally:
                tracer.remove()
                loss.remove()
            t.step = step
            everyone: list[Any] = [None] * ranks.info.world
            dist.all_gather_object(everyone, _mine(t, tracer, trail), group=ranks.control_group)
            windows = [e["window"] for e in everyone]
            rec = combine(windows, names, step=step) if all(w is not None for w in windows) else None
            steps += _updates(everyone, sharded)
            gathered = _Gathered(everyone)
            origin = origin_of(t, step, gathered, rec, kept.step, names, steps, trail.names, history)
            if origin is not None:
                return origin
            history[step] = gathered.peaks
        return None
    finally:
        trail.remove()
        loader.close()
        t.loader, t.window, t.health.every, t.timer = saved
        rank_restore(t, now)
