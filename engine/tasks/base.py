"""What a task is: a model, its data, its loss and its metrics, with its own typed hyperparameters."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict
from torch import nn
from torch.utils.data import default_collate


class NoParams(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _index(obj: Any, idx: torch.Tensor) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj[idx]
    if isinstance(obj, tuple):
        return tuple(_index(o, idx) for o in obj)
    if isinstance(obj, dict):
        return {k: _index(v, idx) for k, v in obj.items()}
    raise TypeError(f"a dataset holds tensors, tuples or dicts of tensors, not {type(obj).__name__}")


def _length(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.shape[0]
    items = list(obj.values()) if isinstance(obj, dict) else list(obj)
    return _length(items[0])


@dataclass
class ArrayData:
    """A dataset held in memory: ``inputs`` (a tensor, a tuple of tensors, or a dict of tensors, each
    with the sample on dim 0) and ``target``. A tuple is passed to the model as positional arguments,
    a dict as keyword arguments."""

    inputs: Any
    target: Any

    def __len__(self) -> int:
        return _length(self.target)

    def take(self, idx: torch.Tensor) -> tuple[Any, Any]:
        """The samples at ``idx`` as ``(inputs, target)``."""
        return _index(self.inputs, idx), _index(self.target, idx)


class Task(ABC):
    """Subclass this in your own file to train your model with Multilane (see examples/)."""

    name: ClassVar[str] = "task"
    description: ClassVar[str] = ""
    Params: ClassVar[type[BaseModel]] = NoParams
    """The task's own hyperparameters: a pydantic model (fields with defaults, bounds, descriptions)."""
    metric: ClassVar[str | None] = None
    """The name of the headline metric in ``metrics()`` (shown in summaries), if any."""
    loss_unit: ClassVar[str | None] = None
    """What ``loss_weight`` counts, when the task names it: ``"tokens"`` for a token-mean cross-entropy
    (the noise scale then counts its batch in tokens, eval records gain ``perplexity``)."""

    def __init__(self, params: BaseModel | None = None) -> None:
        self.params = params if params is not None else self.Params()

    @abstractmethod
    def build_model(self) -> nn.Module:
        """A fresh model (the engine seeds torch first, so the init is reproducible)."""

    @abstractmethod
    def data(self) -> Any:
        """The task's samples, one of:

        - ``ArrayData``: all samples in memory; the engine splits them into training and validation
          sets by the run's seed (``data.val_fraction``);
        - a map-style ``torch.utils.data.Dataset`` whose item ``i`` is ``(inputs, target)``: read by a
          DataLoader (``data.workers``), split the same way by index;
        - an ``IterableDataset`` (a stream of ``(inputs, target)``; needs ``train.steps``);
        - a pair ``(train, validation)`` of any of these (validation may be None): no split.
        """

    def collate(self, samples: list[Any]) -> Any:
        """A batch ``(inputs, target)`` from a list of samples read from a Dataset (default: torch's
        ``default_collate``, which stacks tensors). Runs in the DataLoader's worker processes."""
        return default_collate(samples)

    @abstractmethod
    def loss(self, output: Any, target: Any) -> torch.Tensor:
        """The mean loss over the samples given (0-dim). Lanes' losses are weighted by shard size, or by
        ``loss_weight`` where the task defines it."""

    def loss_weight(self, output: Any, target: Any) -> torch.Tensor | float:
        """What ``loss`` is a mean over, for the samples given: define it when that is not the number of
        samples, e.g. the count of non-padding tokens (``(target != pad).sum()``) for a token-mean
        cross-entropy with ``ignore_index``, or the sum of the targets' class weights
        (``class_weights[target].sum()``) for a class-weighted one. The engine then combines the
        devices' losses as ``Σ wᵢ·lossᵢ / Σ wᵢ``, which is the full-batch loss; a device whose weight is
        0 (all padding) sits that step out. Not defined (the default): the number of samples."""
        raise NotImplementedError

    def metrics(self, output: Any, target: Any) -> dict[str, torch.Tensor]:
        """Means over the samples given, e.g. ``{"accuracy": ...}`` (0-dim tensors); computed at eval."""
        return {}

    def tokens_per_sample(self) -> int | None:
        """Optional: the token positions the model computes per sample (a language model's context); train
        records then gain ``tokens_per_s``."""
        return None

    def base_source(self) -> str | None:
        """Optional: where the model's frozen weights (``requires_grad=False``, e.g. a pretrained base under
        LoRA adapters) come from, a folder or a Hub name. A checkpoint holds only the trainable state and
        names the frozen base by this and a hash of its bytes (docs/run-folder.md); None: the hash alone."""
        return None

    def sample_text(self, model: nn.Module, device: torch.device, step: int) -> str | None:
        """Optional: text the model writes after each evaluation (e.g. a language model's sample). It is
        appended to the run folder's ``samples.txt`` and sent with the eval record as ``sample``."""
        return None


def loss_weight_fn(task: Task) -> Callable[[Any, Any], torch.Tensor | float] | None:
    """The task's ``loss_weight``, or None where the task does not define one (its loss is a per-sample mean)."""
    return task.loss_weight if type(task).loss_weight is not Task.loss_weight else None


def add_token_fields(task: Task, record: dict[str, Any]) -> None:
    """A train record gains ``tokens_per_s`` (the task's ``tokens_per_sample``), an eval record of a task
    whose loss is a token mean gains ``perplexity``: the exponential of that mean (inf past 1e300)."""
    if record.get("kind") == "train":
        per = task.tokens_per_sample()
        sps = record.get("samples_per_s")
        if per and sps is not None:
            record["tokens_per_s"] = float(sps) * per
    elif record.get("kind") == "eval" and task.loss_unit == "tokens":
        v = record.get("val_loss")
        if isinstance(v, float) and v == v:
            record["perplexity"] = math.exp(v) if v < 690.0 else math.inf
