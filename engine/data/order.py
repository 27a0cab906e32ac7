"""Splitting a task's data and walking it in a seeded, resumable order."""

from __future__ import annotations

import math
from typing import Any

import torch
from multilane.engine.parallel.tree import move_tree
from multilane.engine.tasks.base import ArrayData


def split_indices(n: int, val_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample indices ``(train, validation)`` of a seeded random split; the same for ArrayData and Datasets."""
    n_val = round(n * val_fraction)
    if val_fraction > 0 and n_val == 0:
        n_val = 1
    if n_val >= n:
        n_val = n - 1
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return perm[max(n_val, 0) :], perm[: max(n_val, 0)]


def split_data(data: ArrayData, val_fraction: float, seed: int) -> tuple[ArrayData, ArrayData | None]:
    """A seeded random train/validation split (no validation set when val_fraction is 0)."""
    train_idx, val_idx = split_indices(len(data), val_fraction, seed)
    train = ArrayData(*data.take(train_idx))
    val = ArrayData(*data.take(val_idx)) if len(val_idx) > 0 else None
    return train, val


def epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The order of the ``n`` training samples in ``epoch``: a pure function of the run's seed and the epoch."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch + 1))


class Batches:
    """Micro-batch ``m`` of the whole run, by index: epoch ``m // per_epoch``, shuffled by the seed.

    Indexing by position (not a stateful iterator) is what makes resuming exact: a run resumed at
    optimizer step s continues at micro-batch ``s * grad_accum`` with the very same samples.
    """

    def __init__(self, data: ArrayData, batch_size: int, seed: int, device: torch.device | None = None) -> None:
        self.data = ArrayData(move_tree(data.inputs, device), move_tree(data.target, device)) if device else data
        self.n = len(data)
        self.batch_size = min(batch_size, self.n)
        self.seed = seed
        self.per_epoch = math.ceil(self.n / self.batch_size)
        self._epoch = -1
        self._perm: torch.Tensor | None = None
        self._device = device

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            perm = epoch_order(self.n, self.seed, epoch)
            self._perm = perm.to(self._device) if self._device is not None else perm
            self._epoch = epoch
        assert self._perm is not None
        return self._perm

    def indices(self, m: int) -> torch.Tensor:
        """The sample indices of micro-batch ``m``, in order (a ddp rank takes its slice of them)."""
        epoch, pos = divmod(m, self.per_epoch)
        return self._order(epoch)[pos * self.batch_size : (pos + 1) * self.batch_size]

    def get(self, m: int) -> tuple[Any, Any, int]:
        """``(inputs, target, size)`` of micro-batch ``m`` (the last one of an epoch may be smaller)."""
        idx = self.indices(m)
        inputs, target = self.data.take(idx)
        return inputs, target, int(idx.shape[0])


def eval_batches(data: ArrayData, batch_size: int):
    """The validation set in order, in chunks of ``batch_size``."""
    n = len(data)
    for start in range(0, n, batch_size):
        idx = torch.arange(start, min(n, start + batch_size))
        yield (*data.take(idx), int(idx.shape[0]))
