"""Evaluation in a ddp run: each rank evaluates its slice of every validation batch; one gather sums
the ranks' size-weighted losses and metrics into the record the single-process engine writes."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from multilane.engine.parallel.lane_loss import LaneLoss, model_args
from multilane.engine.tasks import Task, add_token_fields
from torch import nn


def evaluate_shards(
    model: nn.Module,
    task: Task,
    shards: Iterable[tuple[Any, Any, int]],
    device_kind: str,
    autocast_dtype: torch.dtype | None,
    loss_weight: Callable[[Any, Any], Any] | None,
    world: int,
    step: int,
) -> dict[str, Any]:
    """The ``"kind": "eval"`` record at ``step`` (a collective: every rank calls it). A batch's loss is
    weighted by its samples, or by the task's ``loss_weight``; metrics are means over samples."""
    was_training = model.training
    model.eval()
    loss_sum = weight_sum = 0.0
    metric_sums: list[float] = []
    keys: list[str] = []
    count = 0
    try:
        with torch.no_grad():
            for inputs, target, n in shards:
                args, kwargs = model_args(inputs)
                cast = torch.autocast(device_kind, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
                with cast:
                    output = model(*args, **kwargs)
                    loss = LaneLoss.check(task.loss(output, target))
                    w = float(n)
                    if loss_weight is not None:
                        w = float(LaneLoss.weight(loss_weight(output, target), loss))
                if w > 0:  # a shard holding no weight (all padding) adds nothing; its mean is 0/0
                    loss_sum += float(loss.double()) * w
                    weight_sum += w
                metrics = task.metrics(output, target)
                keys = list(metrics)
                values = [float(torch.as_tensor(metrics[k]).double()) * n for k in keys]
                metric_sums = values if not metric_sums else [a + b for a, b in zip(metric_sums, values, strict=True)]
                count += n
    finally:
        model.train(was_training)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, (loss_sum, weight_sum, metric_sums, keys, count))
    parts = [e for e in everyone if e[4] > 0]
    keys = parts[0][3] if parts else []
    n_all = sum(e[4] for e in parts)
    w_all = sum(e[1] for e in everyone)
    rec = {
        "kind": "eval",
        "step": step,
        "wall_time": time.time(),
        "val_loss": sum(e[0] for e in everyone) / w_all if w_all > 0 else math.nan,
        "metrics": {k: sum(e[2][i] for e in parts) / n_all for i, k in enumerate(keys)},
    }
    add_token_fields(task, rec)  # a language model's perplexity
    return rec
