"""The plain single-device float64 loop a cell is compared with: forward, the task's loss, backward,
clipping, the optimizer's step, over the batches the run takes (the same task, seed and order).

No engine code trains here: the engine only says which samples make each batch (its data order,
``Trainer._setup``'s loader, as tests/engine/parallel/test_exactness_trainer.py takes them), how it splits
a batch into shares (``chunk_sizes``) and where lane r's random stream starts (``lane_seed``), the
documented rules a run on n devices follows.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from matrix import KINDS, config, devices_for
from multilane.engine.config import build_config
from multilane.engine.parallel import chunk_sizes
from multilane.engine.parallel.lane_loss import model_args
from multilane.engine.parallel.replicas.lane_rng import lane_seed
from multilane.engine.run.trainer import Trainer
from torch.func import functional_call


@dataclass
class Reference:
    losses: list[float]  # each step's loss (the mean of its micro-batches' losses)
    state: dict[str, torch.Tensor]  # the final parameters and buffers


def _take(obj: Any, lo: int, hi: int) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj[lo:hi]
    if isinstance(obj, tuple):
        return tuple(_take(o, lo, hi) for o in obj)
    if isinstance(obj, dict):
        return {k: _take(v, lo, hi) for k, v in obj.items()}
    return obj


def reference(kind: str, strategy: str, tmp: Any) -> Reference:
    row = KINDS[kind]
    cfg = config(kind, strategy, tmp)
    cfg["devices"] = {"use": "cpu:0"}
    cfg["train"].update(fit_check=False, tensorboard=False)
    cfg["health"], cfg["telemetry"] = {"enabled": False}, {"enabled": False}
    built = Trainer(build_config(cfg))
    built._setup()  # the seeded model and the very batches (and order) the run takes; nothing trains
    built.backend.close()
    model, task, batches = built.model, built.task, built.loader.batches
    weight_fn = getattr(task, "loss_weight", None)
    lanes = len(devices_for(kind, strategy)[0].split(","))
    shares = devices_for(kind, strategy)[1] or None
    # Lane 0 draws from the default generator (seeded before the model was built); lane r from its own.
    streams = [None] + [torch.Generator().manual_seed(lane_seed(5, r)).get_state() for r in range(1, lanes)]
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def forward_loss(inputs: Any, target: Any, size: int) -> torch.Tensor:
        if not row.per_share or lanes == 1:
            args, kwargs = model_args(inputs)
            return task.loss(model(*args, **kwargs), target)
        sizes = chunk_sizes(size, lanes, shares)
        named = dict(model.named_buffers())
        losses, weights, merged = [], [], []
        lo = 0
        for r, n in enumerate(sizes):
            if n == 0:
                continue
            args, kwargs = model_args(_take(inputs, lo, lo + n))
            y = _take(target, lo, lo + n)
            lo += n
            own = {k: b.clone() for k, b in named.items()}  # this share's BatchNorm statistics
            outside = torch.get_rng_state()
            if streams[r] is not None:
                torch.set_rng_state(streams[r])
            out = functional_call(model, own, args, kwargs, strict=False)
            if streams[r] is not None:
                streams[r] = torch.get_rng_state()
                torch.set_rng_state(outside)
            w = float(weight_fn(out, y)) if weight_fn is not None else float(n)
            if w > 0:
                losses.append(task.loss(out, y))
                weights.append(w)
            merged.append((n, own))
        for name in named:  # buffers: the sample-weighted mean of the shares' (integers: the first's)
            first = merged[0][1][name]
            new = first if not first.is_floating_point() else sum(n * own[name] for n, own in merged) / size
            mod, _, leaf = name.rpartition(".")
            model.get_submodule(mod)._buffers[leaf] = new.detach()
        return sum(w * loss for w, loss in zip(weights, losses, strict=True)) / sum(weights)

    steps = []
    for step in range(row.steps):
        opt.zero_grad(set_to_none=True)
        micro = []
        for k in range(row.accum):
            inputs, target, size = batches.get(step * row.accum + k)
            loss = forward_loss(inputs, target, size)
            (loss / row.accum if row.accum > 1 else loss).backward()
            micro.append(loss.item())
        if row.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), row.clip)
        opt.step()
        steps.append(sum(micro) / len(micro))
    return Reference(steps, copy.deepcopy({k: v.detach() for k, v in model.state_dict().items()}))
