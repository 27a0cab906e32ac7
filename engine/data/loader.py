"""The run's input pipeline: from what ``Task.data()`` returns to one micro-batch after another.

- ``ArrayData`` (all tensors in memory) stays on the in-memory path (``ArrayLoader``): a batch is one
  indexing of the tensors, on the device itself on a GPU run. A DataLoader would only add work there.
- A map-style ``Dataset`` (or a pair ``(train, validation)``) is read by a ``torch.utils.data.DataLoader``
  (``DatasetLoader``): worker processes, prefetch, pinned memory and ``non_blocking`` copies on CUDA.
  Its sampler starts at the micro-batch a run resumes from, so nothing before it is read again.
- An ``IterableDataset`` is a stream (``StreamLoader``): it is read in order, pass after pass; a resumed
  run reads the stream again from its start and drops the micro-batches the run had already taken.

Every loader yields ``(inputs, target, size)`` and evaluates in order; ``start(m0, stop)`` says which
micro-batches the run will take.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from multilane.engine.data.order import Batches, epoch_order, eval_batches, split_data, split_indices
from multilane.engine.data.sampling import (
    DataError,
    EvalBatchSampler,
    RunBatchSampler,
    SeededReader,
    batch_size_of,
)
from multilane.engine.data.workers import LoaderOptions, next_batch
from multilane.engine.errors import UserError
from multilane.engine.parallel.tree import move_tree
from multilane.engine.tasks.base import ArrayData, Task
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

Batch = tuple[Any, Any, int]


class Loader(Protocol):
    n: int | None
    """Training samples (None for a stream of unknown length)."""
    per_epoch: int | None
    """Micro-batches per epoch (None for a stream of unknown length)."""
    has_val: bool
    workers: int

    def start(self, m0: int, stop: int) -> None:
        """The run takes micro-batches ``m0`` to ``stop - 1``, in that order."""

    def epoch_at(self, m: int) -> int:
        """The epoch micro-batch ``m`` falls in (0 for a stream of unknown length)."""

    def epoch_fraction(self, m: int) -> float | None:
        """Epochs done after ``m`` micro-batches (None for a stream of unknown length)."""

    def next(self) -> Batch:
        """The next micro-batch: ``(inputs, target, samples)``."""

    def eval_batches(self) -> Iterator[Batch]:
        """The validation set in order."""

    def close(self) -> None:
        """Stop the worker processes (if any)."""


def default_workers() -> int:
    """One worker process per core but one (the training thread needs one), at most 8."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not on Linux
        cores = os.cpu_count() or 1
    return max(0, min(8, cores - 1))


def build_loader(task: Task, cfg: Any, device: torch.device | None) -> Loader:
    """The loader for ``task`` under the run config ``cfg``; ``device``: where batches go (a GPU), or None.

    Raises UserError (one line) when ``Task.data()`` returns something the engine cannot train on.
    """
    data = task.data()
    seed, bs, frac = cfg.train.seed, cfg.data.batch_size, cfg.data.val_fraction
    workers = default_workers() if cfg.data.workers is None else cfg.data.workers
    opts = LoaderOptions(task, workers, cfg.data.prefetch, device)
    if isinstance(data, ArrayData):
        train, val = split_data(data, frac, seed)
        loader = ArrayLoader(_non_empty(train, task), val, bs, seed, device)
        loader.train_index = split_indices(len(data), frac, seed)[0]
        return loader
    if isinstance(data, tuple) and len(data) == 2:
        train, val = data
        if isinstance(train, ArrayData) and (val is None or isinstance(val, ArrayData)):
            return ArrayLoader(_non_empty(train, task), val, bs, seed, device)
        _check_dataset(task, train, "the training set")
        if val is not None:
            _check_dataset(task, val, "the validation set")
        if isinstance(train, IterableDataset):
            return StreamLoader(train, val, bs, seed, opts)
        return DatasetLoader(_non_empty(train, task), None, val, None, bs, seed, opts)
    _check_dataset(task, data, "data()")
    if isinstance(data, IterableDataset):
        return StreamLoader(data, None, bs, seed, opts)
    train_idx, val_idx = split_indices(len(data), frac, seed)
    _non_empty(train_idx, task)
    val = data if len(val_idx) else None
    return DatasetLoader(data, train_idx.tolist(), val, val_idx.tolist(), bs, seed, opts)


def _non_empty(data: Any, task: Task) -> Any:
    if len(data) == 0:
        raise UserError(f"task {task.name}: no training samples")
    return data


def _check_dataset(task: Task, obj: Any, what: str) -> None:
    if isinstance(obj, IterableDataset):
        return
    if not (hasattr(obj, "__getitem__") and hasattr(obj, "__len__")) or isinstance(obj, (str, bytes, dict, ArrayData)):
        raise UserError(
            f"task {task.name}: {what} is a {type(obj).__name__}; data() returns ArrayData, a torch Dataset "
            "(map-style or IterableDataset), or a pair (train, validation) of them"
        )


class _Epochs:
    per_epoch: int | None

    def epoch_at(self, m: int) -> int:
        return m // self.per_epoch if self.per_epoch else 0

    def epoch_fraction(self, m: int) -> float | None:
        return round(m / self.per_epoch, 4) if self.per_epoch else None


class ArrayLoader(_Epochs):
    """In-memory data: micro-batch ``m`` is one indexing of the tensors (``Batches``), no DataLoader."""

    workers = 0

    def __init__(
        self, train: ArrayData, val: ArrayData | None, batch_size: int, seed: int, device: torch.device | None
    ) -> None:
        on_gpu = device if device is not None and device.type == "cuda" else None
        self.batches = Batches(train, batch_size, seed, on_gpu)
        self.n, self.per_epoch = self.batches.n, self.batches.per_epoch
        self.val = (
            val
            if val is None or on_gpu is None
            else ArrayData(move_tree(val.inputs, on_gpu), move_tree(val.target, on_gpu))
        )
        self.has_val = val is not None
        self.batch_size = batch_size
        self._m = 0

    def start(self, m0: int, stop: int) -> None:
        self._m = m0

    def next(self) -> Batch:
        batch = self.batches.get(self._m)
        self._m += 1
        return batch

    train_index: torch.Tensor | None = None
    """The task's sample index of each training sample (after the split), or None: the same."""

    def sample_indices(self, m: int) -> list[int]:
        """The task's indices of the samples of micro-batch ``m``, in batch order."""
        idx = self.batches.indices(m).cpu()
        return (self.train_index[idx] if self.train_index is not None else idx).tolist()

    def eval_batches(self) -> Iterator[Batch]:
        assert self.val is not None
        return eval_batches(self.val, self.batch_size)

    def close(self) -> None:
        pass


class _DataLoaderReader(_Epochs):
    """What the two DataLoader-backed loaders share: a batch's size and device copy, and evaluation.
    Subclasses set ``opts``, ``seed``, ``batch_size``, ``_val`` and ``_val_loader``."""

    opts: LoaderOptions
    seed: int
    batch_size: int
    _val: Any
    _val_loader: DataLoader | None

    def _batch(self, inputs: Any, target: Any) -> Batch:
        size = batch_size_of(target, inputs)
        inputs, target = self.opts.to_device(inputs, target)
        return inputs, target, size

    def eval_batches(self) -> Iterator[Batch]:
        if self._val_loader is None:
            self._val_loader = _eval_loader(self._val, self.batch_size, self.seed, self.opts)
        return _eval_iter(self._val_loader, self.opts)


class DatasetLoader(_DataLoaderReader):
    """A map-style Dataset read by a DataLoader whose sampler starts at the run's micro-batch ``m0``."""

    def __init__(
        self,
        train: Any,
        train_idx: list[int] | None,
        val: Any,
        val_idx: list[int] | None,
        batch_size: int,
        seed: int,
        opts: LoaderOptions,
    ) -> None:
        self.opts, self.seed, self.batch_size = opts, seed, batch_size
        self.workers = opts.workers
        self.train = SeededReader(train, train_idx, seed, "training")
        self.n = len(self.train)
        self.per_epoch = -(-self.n // min(batch_size, self.n))
        self.has_val = val is not None
        self._val_loader: DataLoader | None = None
        self._val: Any = None
        if val is not None:
            self._val = val if isinstance(val, IterableDataset) else SeededReader(val, val_idx, seed + 1, "validation")
        self._it: Iterator[Any] | None = None

    def start(self, m0: int, stop: int) -> None:
        sampler = RunBatchSampler(self.n, self.batch_size, self.seed, m0, stop)
        loader = self.opts.dataloader(
            self.train, False, self.seed, batch_sampler=sampler, collate_fn=self.opts.collate("training")
        )
        self._it = iter(loader)  # the workers start here and live until the run ends

    def sample_indices(self, m: int) -> list[int]:
        """The dataset's indices of the samples of micro-batch ``m``, in batch order (as the sampler takes them)."""
        bs = min(self.batch_size, self.n)
        epoch, pos = divmod(m, -(-self.n // bs))
        idx = epoch_order(self.n, self.seed, epoch)[pos * bs : (pos + 1) * bs].tolist()
        return [self.train.indices[i] for i in idx] if self.train.indices is not None else idx

    def next(self) -> Batch:
        assert self._it is not None, "start() first"
        try:
            inputs, target = next_batch(self._it, self.workers)
        except StopIteration:
            raise RuntimeError("the run asked for more micro-batches than it planned") from None
        return self._batch(inputs, target)

    def close(self) -> None:
        self._it = None  # dropping the iterator shuts its workers down
        self._val_loader = None


def _eval_loader(val: Any, batch_size: int, seed: int, opts: LoaderOptions) -> DataLoader:
    if isinstance(val, IterableDataset):
        return opts.dataloader(
            _CountedStream(val, "validation"), False, seed, batch_size=batch_size, collate_fn=opts.collate("validation")
        )
    sampler = EvalBatchSampler(len(val), batch_size)
    # Persistent: evaluation runs many times, its workers are started once.
    return opts.dataloader(val, True, seed, batch_sampler=sampler, collate_fn=opts.collate("validation"))


def _eval_iter(loader: DataLoader, opts: LoaderOptions) -> Iterator[Batch]:
    it = iter(loader)
    while True:
        try:
            inputs, target = next_batch(it, opts.workers)
        except StopIteration:
            return
        size = batch_size_of(target, inputs)
        inputs, target = opts.to_device(inputs, target)
        yield inputs, target, size


class _CountedStream(IterableDataset):
    """An IterableDataset whose failures name the item (counted per worker) that could not be read."""

    def __init__(self, stream: IterableDataset, what: str) -> None:
        self.stream, self.what = stream, what

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.stream)
        k = 0
        while True:
            try:
                item = next(it)
            except StopIteration:
                return
            except Exception as e:
                info = get_worker_info()
                where = f" of worker {info.id}'s share" if info is not None else ""
                raise DataError(f"reading {self.what} stream item {k}{where} failed: {type(e).__name__}: {e}") from e
            k += 1
            yield item


class StreamLoader(_DataLoaderReader):
    """An IterableDataset: read in order, pass after pass. Its resume replays: the stream is read from its
    start again and the micro-batches the run had already taken are dropped (a stream cannot seek)."""

    n = None
    per_epoch = None

    def __init__(self, train: IterableDataset, val: Any, batch_size: int, seed: int, opts: LoaderOptions) -> None:
        self.opts, self.seed, self.batch_size = opts, seed, batch_size
        self.workers = opts.workers
        self.has_val = val is not None
        self._val = (
            val if val is None or isinstance(val, IterableDataset) else SeededReader(val, None, seed + 1, "validation")
        )
        self._val_loader: DataLoader | None = None
        self._loader = opts.dataloader(
            _CountedStream(train, "training"),
            True,
            seed,
            batch_size=batch_size,
            collate_fn=opts.collate("training"),
        )
        self._it: Iterator[Any] | None = None
        self.passes = 0

    def start(self, m0: int, stop: int) -> None:
        self._it = iter(self._loader)
        for _ in range(m0):
            self._take()

    def _take(self) -> Any:
        assert self._it is not None, "start() first"
        for attempt in range(2):
            try:
                return next_batch(self._it, self.workers)
            except StopIteration:
                if attempt:
                    break
                self.passes += 1
                self._it = iter(self._loader)
        raise DataError("the training stream yields no samples")

    def next(self) -> Batch:
        return self._batch(*self._take())

    def close(self) -> None:
        self._it = None
        self._loader = None  # type: ignore[assignment]
        self._val_loader = None
