"""Evaluation: the validation loss and the task's metrics, the model's output computed on every lane."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from multilane.engine.data import eval_batches
from multilane.engine.parallel.tree import move_tree
from multilane.engine.tasks import ArrayData, Task
from torch import nn


def evaluate(
    strategy: Any,
    model: nn.Module,
    task: Task,
    val: ArrayData,
    batch_size: int,
    sizes: Callable[[int], Sequence[int]],
    output_device: torch.device,
    step: int,
) -> dict[str, Any]:
    """The ``"kind": "eval"`` record at ``step``: sample-weighted means over the whole validation set."""
    was_training = model.training
    model.eval()
    total = None
    count = 0
    keys: list[str] = []
    try:
        with torch.no_grad():
            for inputs, target, size in eval_batches(val, batch_size):
                output = strategy.forward(model, inputs, sizes(size))
                target = move_tree(target, output_device)
                loss = task.loss(output, target)
                metrics = task.metrics(output, target)
                keys = list(metrics)
                vec = torch.stack([loss.float(), *(torch.as_tensor(metrics[k]).float() for k in keys)]) * size
                total = vec if total is None else total + vec
                count += size
    finally:
        model.train(was_training)
    assert total is not None
    values = (total / count).tolist()
    return {
        "kind": "eval",
        "step": step,
        "wall_time": time.time(),
        "val_loss": values[0],
        "metrics": dict(zip(keys, values[1:], strict=True)),
    }
