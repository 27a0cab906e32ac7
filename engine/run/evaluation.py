"""Evaluation: the validation loss and the task's metrics, the model's output computed on every lane."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from multilane.engine.parallel import ReplicateEachStep
from multilane.engine.parallel.timing import NoTimer
from multilane.engine.parallel.tree import move_tree
from multilane.engine.rundir.runlog import SAMPLES, RunDir
from multilane.engine.tasks import Task, add_token_fields, loss_weight_fn
from torch import nn

if TYPE_CHECKING:
    from multilane.engine.run.trainer import Trainer


def evaluate(
    strategy: ReplicateEachStep,
    model: nn.Module,
    task: Task,
    batches: Iterable[tuple[Any, Any, int]],
    sizes: Callable[[int], Sequence[int]],
    output_device: torch.device,
    step: int,
) -> dict[str, Any]:
    """The ``"kind": "eval"`` record at ``step``: means over the whole validation set (``batches``: its
    ``(inputs, target, samples)`` in order, from the loader).

    The loss is computed as in training, by the same code: on every lane, inside autocast with the run's
    dtype, combined by shard size or by the task's ``loss_weight``; batches are combined the same way
    (by their sample count or their total loss weight), so the validation loss is the loss of the whole
    validation set on any lane count. The task's metrics (means over samples) are computed on the output
    gathered from every lane. Sums are kept in float64: a float64 loss is not rounded.
    """
    was_training = model.training
    model.eval()
    weight_fn = loss_weight_fn(task)
    loss_sum = weight_sum = metric_sums = None
    count = 0
    keys: list[str] = []
    timer = NoTimer()  # evaluation's phases are no step's
    try:
        with torch.no_grad():
            for inputs, target, size in batches:
                out = strategy.forward_loss(
                    model, inputs, target, task.loss, sizes(size), timer, weight_fn=weight_fn, keep_output=True
                )
                w = out.weight.double() if out.weight is not None else torch.tensor(float(size), dtype=torch.float64)
                w = w.to(out.loss.device)
                # A batch holding no weight (all padding) adds nothing; its own mean is 0/0.
                part = torch.where(w > 0, out.loss.double() * w, torch.zeros_like(w))
                loss_sum = part if loss_sum is None else loss_sum + part
                weight_sum = w if weight_sum is None else weight_sum + w
                metrics = task.metrics(out.output, move_tree(target, output_device))
                keys = list(metrics)
                if keys:
                    vec = torch.stack([torch.as_tensor(metrics[k]).double().to(output_device) for k in keys]) * size
                    metric_sums = vec if metric_sums is None else metric_sums + vec
                count += size
    finally:
        model.train(was_training)
    assert loss_sum is not None and weight_sum is not None
    val_loss = (loss_sum / weight_sum).item()
    values = (metric_sums / count).tolist() if metric_sums is not None else []
    rec = {
        "kind": "eval",
        "step": step,
        "wall_time": time.time(),
        "val_loss": val_loss,
        "metrics": dict(zip(keys, values, strict=True)),
    }
    add_token_fields(task, rec)  # a language model's perplexity
    return rec


def write_sample(task: Task, model: nn.Module, device: torch.device, record: dict[str, Any], run_dir: RunDir) -> None:
    """The task's text sample at this evaluation (``Task.sample_text``, if it writes one): appended to the
    run folder's samples.txt and sent with the eval record as ``sample``."""
    text = task.sample_text(model, device, record["step"])
    if text:
        record["sample"] = text
        run_dir.append_text(SAMPLES, f"--- step {record['step']}\n{text}\n")


def evaluate_run(t: Trainer) -> None:
    """A single-process run's evaluation at its step: the record to the callbacks, the task's sample written."""
    if not t.loader.has_val:
        return
    rec = evaluate(t.strategy, t.model, t.task, t.loader.eval_batches(), t._sizes, t.backend.output_device, t.step)
    assert t.run_dir is not None
    write_sample(t.task, t.model, t.backend.model_device, rec, t.run_dir)
    t.publish_eval(rec)
