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
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
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

if TYPE_CHECKING:
    from multilane.engine.distributed.trainer import DdpTrainer


def _streams(t: DdpTrainer) -> list[torch.Generator]:
    return _generators(t.info.device.torch_device())


def rank_snapshot(t: DdpTrainer, into: Kept | None = None) -> Kept:
    """This rank's state before a log window: its own random streams (no collective)."""
    return snapshot(t, into, lane_rng=[g.get_state() for g in _streams(t)])


def rank_restore(t: DdpTrainer, k: Kept) -> None:
    def put(states: list[torch.Tensor]) -> None:
        for g, s in zip(_streams(t), states, strict=False):
            g.set_state(s)

    restore(t, k, put)


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
    from multilane.engine.data.loader import build_loader
    from multilane.engine.distributed.shards import RankLoader
    from multilane.engine.distributed.window import ShardWindow, combine

    names = t.lane_names
    bad = weights_origin(kept, names[0])  # the same on every rank: DDP keeps the ranks' weights equal
    if bad is not None:
        return bad
    now = rank_snapshot(t)
    saved = (t.loader, t.window, t.health.every, t.timer)
    accum = t.config.train.grad_accum
    dev = t.info.device
    loader = RankLoader(build_loader(t.task, t.config, dev.torch_device() if dev.is_cuda else None), t._my_slice)
    try:
        rank_restore(t, kept)
        loader.start(kept.step * accum, last_step * accum)
        t.loader, t.health.every = loader, 0
        for step in range(kept.step + 1, last_step + 1):
            t.window = ShardWindow()
            tracer = Tracer(t.model, [], single=True)
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
            everyone: list[Any] = [None] * t.info.world
            dist.all_gather_object(everyone, mine, group=t._control_group)
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
