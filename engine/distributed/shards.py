"""A ddp rank's input: its shard of every global micro-batch the single-process engine takes.

This is our DistributedSampler. The single-process loaders (``engine/data/loader.py``) define global
micro-batch ``m`` as a pure function of the run's seed and ``m``; rank ``r`` takes the ``r``-th chunk
of it (``chunk_sizes``, as lanes get theirs), so every rank count trains on the same global batches
and a resume at micro-batch ``m0`` continues exactly, on any number of processes.

- ``ArrayData``: one indexing of the tensors with the rank's slice of ``Batches.indices(m)``.
- A map-style ``Dataset``: a DataLoader (``data.workers`` processes) whose batch sampler yields only the
  rank's slice of each micro-batch, so each rank reads only its own samples. Each sample is read with
  generators seeded by ``(seed, m, sample)`` (``SeededReader``), so random augmentations do not depend
  on which rank reads a sample.
- An ``IterableDataset`` (a stream cannot be split by index): every rank reads the whole stream, as
  the single-process engine does, and keeps its slice of each collated global batch.

Each yields ``(inputs, target, n, size)``: the rank's ``n`` samples of a micro-batch of ``size``. A
rank whose slice is empty still runs the model (DDP needs every rank in the gradient all-reduce): on
nothing (``ArrayData``, streams) or on the batch's first sample (a Dataset: a collate cannot make a
batch of zero samples); ``n == 0`` tells the trainer to weight it by zero.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from multilane.engine.data.loader import ArrayLoader, DatasetLoader, Loader, StreamLoader, _eval_iter
from multilane.engine.data.sampling import EvalBatchSampler, RunBatchSampler, SeededReader
from multilane.engine.data.workers import next_batch
from multilane.engine.parallel.tree import scatter_tree
from torch.utils.data import IterableDataset

Shard = tuple[Any, Any, int, int]
Slicer = Callable[[int], tuple[int, int]]
"""``size -> (start, n)``: where this rank's slice of a batch of ``size`` samples starts, and its length."""


def slice_tree(obj: Any, start: int, n: int) -> Any:
    """Samples ``start`` to ``start + n`` (dim 0) of every tensor in a collated batch."""
    return scatter_tree(obj, 1, lambda t: [t[start : start + n]])[0]


class ShardBatchSampler(RunBatchSampler):
    """The run's micro-batches ``start`` to ``stop - 1``, each cut to this rank's slice: ``(m, index)``
    keys as ``RunBatchSampler`` yields them. An empty slice yields the batch's first key (read, then
    weighted by zero)."""

    def __init__(self, n: int, batch_size: int, seed: int, start: int, stop: int, slicer: Slicer) -> None:
        super().__init__(n, batch_size, seed, start, stop)
        self.slicer = slicer

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        for keys in super().__iter__():
            begin, n = self.slicer(len(keys))
            yield keys[begin : begin + n] if n else keys[:1]


class ShardEvalSampler(EvalBatchSampler):
    """The validation set in order, each chunk cut to this rank's slice; empty slices are left out."""

    def __init__(self, n: int, batch_size: int, slicer: Slicer) -> None:
        super().__init__(n, batch_size)
        self.slicer = slicer

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        for keys in super().__iter__():
            begin, n = self.slicer(len(keys))
            if n:
                yield keys[begin : begin + n]


class RankLoader:
    """The run's loader as one rank sees it: the loader's epochs and sizes, the rank's shards."""

    def __init__(self, loader: Loader, slicer: Slicer) -> None:
        self.base, self.slicer = loader, slicer
        self.n, self.per_epoch, self.has_val = loader.n, loader.per_epoch, loader.has_val
        self.workers = loader.workers
        self._m = 0
        self._it: Iterator[Any] | None = None
        self._val_loader: Any = None

    def epoch_at(self, m: int) -> int:
        return self.base.epoch_at(m)

    def epoch_fraction(self, m: int) -> float | None:
        return self.base.epoch_fraction(m)

    def sample_indices(self, m: int) -> list[int] | None:
        """The task's indices of the whole micro-batch ``m`` (every rank's shard), where the loader knows them."""
        return self.base.sample_indices(m) if hasattr(self.base, "sample_indices") else None

    def start(self, m0: int, stop: int) -> None:
        self._m = m0
        if isinstance(self.base, DatasetLoader):
            b = self.base
            sampler = ShardBatchSampler(b.n, b.batch_size, b.seed, m0, stop, self.slicer)
            collate = b.opts.collate("training")
            self._it = iter(b.opts.dataloader(b.train, False, b.seed, batch_sampler=sampler, collate_fn=collate))
        else:
            self.base.start(m0, stop)

    def next_shard(self) -> Shard:
        """This rank's part of the run's next micro-batch."""
        base, m = self.base, self._m
        self._m += 1
        if isinstance(base, ArrayLoader):
            idx = base.batches.indices(m)
            size = int(idx.shape[0])
            start, n = self.slicer(size)
            inputs, target = base.batches.data.take(idx[start : start + n])
            return inputs, target, n, size
        if isinstance(base, DatasetLoader):
            assert self._it is not None, "start() first"
            bs = min(base.batch_size, base.n)
            size = min(bs, base.n - (m % base.per_epoch) * bs)
            try:
                inputs, target = next_batch(self._it, base.workers)
            except StopIteration:
                raise RuntimeError("the run asked for more micro-batches than it planned") from None
            inputs, target, _ = base._batch(inputs, target)
            return inputs, target, self.slicer(size)[1], size
        assert isinstance(base, StreamLoader)
        inputs, target, size = base.next()
        start, n = self.slicer(size)
        return slice_tree(inputs, start, n), slice_tree(target, start, n), n, size

    def eval_shards(self) -> Iterator[tuple[Any, Any, int]]:
        """This rank's slice of every validation batch, in order (empty slices left out)."""
        base = self.base
        if isinstance(base, ArrayLoader):
            assert base.val is not None
            bs, n_val = base.batch_size, len(base.val)
            for b0 in range(0, n_val, bs):
                start, n = self.slicer(min(bs, n_val - b0))
                if n:
                    yield (*base.val.take(torch.arange(b0 + start, b0 + start + n)), n)
            return
        val = getattr(base, "_val", None)
        if isinstance(val, SeededReader):  # map-style: read only this rank's samples
            if self._val_loader is None:
                sampler = ShardEvalSampler(len(val), base.batch_size, self.slicer)
                collate = base.opts.collate("validation")
                self._val_loader = base.opts.dataloader(val, True, base.seed, batch_sampler=sampler, collate_fn=collate)
            for inputs, target, n in _eval_iter(self._val_loader, base.opts):
                yield inputs, target, n
            return
        assert isinstance(val, IterableDataset)  # a stream: read it all, keep this rank's slices
        for inputs, target, size in base.eval_batches():
            start, n = self.slicer(size)
            if n:
                yield slice_tree(inputs, start, n), slice_tree(target, start, n), n

    def close(self) -> None:
        self._it = None
        self._val_loader = None
        self.base.close()
