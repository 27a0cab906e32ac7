"""Reading through torch's DataLoader: the loader options a run's data takes (workers, prefetch, pinned
memory, seeded workers that leave the stop signals to the run) and the next batch, with a dead
worker or a worker's exception turned into a line that names it."""

from __future__ import annotations

import contextlib
import os
import random
import signal
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from multilane.engine.data.sampling import Collate, DataError, clean_worker_error, quiet_sigchld, worker_death
from multilane.engine.parallel.tree import move_tree
from multilane.engine.tasks.base import Task
from torch.utils.data import DataLoader


class LoaderOptions:
    def __init__(self, task: Task, workers: int, prefetch: int, device: torch.device | None) -> None:
        self.task, self.workers, self.prefetch, self.device = task, workers, prefetch, device
        self.pin = device is not None and device.type == "cuda"

    def collate(self, what: str) -> Collate:
        return Collate(self.task.collate, what)

    def dataloader(self, dataset: Any, persistent: bool, seed: int, **kw: Any) -> DataLoader:
        extra: dict[str, Any] = {}
        if self.workers > 0:
            extra = {"prefetch_factor": self.prefetch, "persistent_workers": persistent}
            extra["worker_init_fn"] = ignore_stop_signals
        return DataLoader(
            dataset,
            num_workers=self.workers,
            pin_memory=self.pin,
            # Worker seeds (torch, random, numpy) follow from the run's seed, not from the global RNG.
            generator=torch.Generator().manual_seed(seed),
            **extra,
            **kw,
        )

    def to_device(self, inputs: Any, target: Any) -> tuple[Any, Any]:
        if self.device is None:
            return inputs, target
        return move_tree(inputs, self.device, non_blocking=self.pin), move_tree(target, self.device, self.pin)


def ignore_stop_signals(worker_id: int) -> None:
    """A DataLoader worker leaves the stop signals to the process that reads from it, which stops the
    run at a step with a checkpoint and then ends its workers. A signal sent to the whole process
    group (the ddp launcher's, torch's elastic agent's, a terminal's Ctrl+C) would otherwise kill a
    worker first, and the run would fail on the lost worker instead of stopping. So the worker leaves
    that group (its own process group) rather than ignoring SIGTERM: a SIGTERM sent to the worker
    itself (multiprocessing's ``terminate()`` at the reader's exit, after a failed run) still ends it;
    ignored, the reader's exit waited for it for ever. A worker whose reader dies is ended by torch's
    watchdog, as before."""
    os.setpgrp()
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@contextlib.contextmanager
def keep_rng(active: bool):
    """Read in the main process (no workers): the per-batch seeding must not touch the run's generators."""
    if not active:
        yield
        return
    state = torch.get_rng_state(), random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        torch.set_rng_state(state[0])
        random.setstate(state[1])
        np.random.set_state(state[2])


def next_batch(it: Iterator[Any], workers: int) -> Any:
    if workers > 0:
        quiet_sigchld()  # set by torch as the iterator started its workers
    try:
        with keep_rng(workers == 0):
            return next(it)
    except DataError as e:
        if workers > 0:
            raise DataError(clean_worker_error(e)) from e
        raise
    except (RuntimeError, OSError, EOFError) as e:  # a worker that died: torch's words, or a reset pipe
        death = worker_death(it) if workers > 0 else None
        if death is None:
            raise
        raise DataError(death) from e
