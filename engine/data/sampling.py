"""Which samples each micro-batch of a run takes, and how a worker reads them.

The order of every epoch is a pure function of the run's seed and the epoch (``epoch_order``, the same
one the in-memory path uses), so micro-batch ``m`` of a run is known without reading any other. A run
that resumes at micro-batch ``m0`` starts its sampler there: the samples before it are never read.

Each sample is read with the random generators (torch, random, numpy) seeded from the run's seed, the
micro-batch's number and the sample, so random augmentations depend on neither the worker count, nor
where the run was resumed, nor which ddp rank reads the sample.
"""

from __future__ import annotations

import contextlib
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from multilane.engine.data.order import epoch_order
from multilane.engine.parallel.tree import first_tensor
from torch.utils.data import Dataset, Sampler

_MASK64 = (1 << 64) - 1


class DataError(RuntimeError):
    """Reading a sample or collating a batch failed; the message names the sample and where."""


def batch_seed(seed: int, m: int) -> int:
    """The seed of micro-batch ``m``'s random generators (a 64-bit mix of the run's seed and ``m``)."""
    x = (seed * 0x9E3779B97F4A7C15 + (m + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    x ^= x >> 31
    x = (x * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 29)


def seed_generators(seed: int) -> None:
    """Seed the CPU generators a dataset's transforms draw from (never the CUDA ones)."""
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a dependency
        return
    np.random.seed(seed & 0xFFFFFFFF)


class RunBatchSampler(Sampler[list[tuple[int, int]]]):
    """Micro-batches ``start, start + 1, ..., stop - 1`` of the run, as lists of ``(m, sample index)``.

    Micro-batch ``m`` is the ``m % per_epoch``-th slice of ``batch_size`` samples of epoch
    ``m // per_epoch``'s order; the last slice of an epoch may be smaller.
    """

    def __init__(self, n: int, batch_size: int, seed: int, start: int, stop: int) -> None:
        self.n, self.batch_size, self.seed = n, min(batch_size, n), seed
        self.per_epoch = -(-n // self.batch_size)
        self.start, self.stop = start, stop

    def __len__(self) -> int:
        return max(0, self.stop - self.start)

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        epoch, order = -1, torch.empty(0, dtype=torch.long)
        for m in range(self.start, self.stop):
            e, pos = divmod(m, self.per_epoch)
            if e != epoch:
                epoch, order = e, epoch_order(self.n, self.seed, e)
            idx = order[pos * self.batch_size : (pos + 1) * self.batch_size].tolist()
            yield [(m, i) for i in idx]


class EvalBatchSampler(Sampler[list[tuple[int, int]]]):
    """The validation set in order, in chunks of ``batch_size``, as lists of ``(chunk, sample index)``."""

    def __init__(self, n: int, batch_size: int) -> None:
        self.n, self.batch_size = n, batch_size

    def __len__(self) -> int:
        return -(-self.n // self.batch_size)

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        for k, start in enumerate(range(0, self.n, self.batch_size)):
            yield [(k, i) for i in range(start, min(self.n, start + self.batch_size))]


class SeededReader(Dataset):
    """A dataset as the DataLoader's workers read it: one micro-batch at a time, with its own seed.

    ``indices`` maps positions to the user's dataset (the train or validation part of a split);
    ``what`` names the part in errors ("training", "validation").
    """

    def __init__(self, dataset: Any, indices: list[int] | None, seed: int, what: str) -> None:
        self.dataset, self.indices, self.seed, self.what = dataset, indices, seed, what

    def __len__(self) -> int:
        return len(self.indices) if self.indices is not None else len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: list[tuple[int, int]]) -> list[Any]:
        out = []
        for m, pos in keys:
            # Each sample's own seed: the same whichever part of its batch is read (a ddp rank's slice).
            seed_generators(batch_seed(batch_seed(self.seed, m), pos))
            i = self.indices[pos] if self.indices is not None else pos
            try:
                out.append(self.dataset[i])
            except Exception as e:
                raise DataError(f"reading {self.what} sample {i} failed: {type(e).__name__}: {e}") from e
            except SystemExit as e:  # in a worker it would end the process silently, naming nothing
                raise DataError(
                    f"reading {self.what} sample {i} failed: the task's code called sys.exit({e.code})"
                ) from None
        return out


class Collate:
    """The task's collate function, its result checked and brought to ``(inputs, target)``."""

    def __init__(self, fn: Callable[[list[Any]], Any], what: str) -> None:
        self.fn, self.what = fn, what

    def __call__(self, samples: list[Any]) -> tuple[Any, Any]:
        try:
            batch = self.fn(samples)
        except Exception as e:
            raise DataError(
                f"collating a {self.what} batch of {len(samples)} samples failed: {type(e).__name__}: {e}"
            ) from e
        return as_pair(batch, self.what)


def as_pair(batch: Any, what: str = "training") -> tuple[Any, Any]:
    """A collated batch as ``(inputs, target)``: default_collate turns a sample's tuple into a list, so
    lists become tuples again (a tuple of inputs is passed to the model as positional arguments)."""
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        kind = type(batch).__name__ + (f" of {len(batch)}" if isinstance(batch, (tuple, list)) else "")
        raise DataError(
            f"a {what} batch must be a pair (inputs, target): each sample (inputs, target), or a collate "
            f"that returns one; got a {kind}"
        )
    inputs, target = batch
    return (tuple(inputs) if isinstance(inputs, list) else inputs), target


def batch_size_of(target: Any, inputs: Any) -> int:
    """Samples in a batch: dim 0 of its target (or of its inputs when the target holds no tensor)."""
    t = first_tensor(target)
    if t is None or t.dim() == 0:
        t = first_tensor(inputs)
    if t is None or t.dim() == 0:
        raise DataError("a batch must hold tensors with the sample on dim 0")
    return int(t.shape[0])


def clean_worker_error(e: BaseException) -> str:
    """The one line of a DataError re-raised from a DataLoader worker ("Caught DataError in DataLoader
    worker process 1. Original Traceback ... DataError: <line>"), with the worker named."""
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    if not lines or not lines[0].startswith("Caught "):
        return str(e)
    head, last = lines[0], lines[-1]
    where = head.split(" in ", 1)[1].rstrip(".") if " in " in head else "a worker"
    text = last.split("DataError: ", 1)[1] if "DataError: " in last else last
    return f"{text} (in {where})"


def quiet_sigchld() -> None:
    """Undo torch's SIGCHLD handler (main thread only, as torch sets it).

    torch raises "DataLoader worker exited unexpectedly" from that handler, inside whatever the main
    thread is doing when a worker ends: a status write, a checkpoint's rename. The run then died with a
    traceback and its status.json said "running". Without it, the iterator notices a dead worker
    itself (torch checks its workers every few seconds while it waits for a batch) and ``worker_death``
    turns that into one line at the step that needed the batch.
    """
    if threading.current_thread() is threading.main_thread():
        with contextlib.suppress(ValueError, OSError):
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)


def worker_death(it: Any, wait_s: float = 3.0) -> str | None:
    """What happened to a DataLoader iterator's worker processes that ended, or None if none did.

    The error that brings us here can come a moment before the worker can be reaped (a pipe reset as
    the dying process closes its sockets): wait up to ``wait_s`` for one to have ended."""
    workers = list(getattr(it, "_workers", ()) or ())
    end = time.monotonic() + wait_s
    while workers and not any(w.exitcode for w in workers) and time.monotonic() < end:
        time.sleep(0.05)
    dead = []
    for k, w in enumerate(workers):
        code = w.exitcode
        if code is None or code == 0:
            continue
        if code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
        else:
            how = f"exited with status {code}"
        dead.append(f"DataLoader worker {k} (pid {w.pid}) {how}")
    if not dead:
        return None
    return "; ".join(dead) + " while reading a batch (its sample is not known: the worker ended without a word)"
