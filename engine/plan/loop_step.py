"""The run's own step as the fit probe drives it (probe.py): the loop's strategy set up with no run folder
(the lanes, or one ddp or fsdp rank in a process group of the probe's), the probe's batch handed to it as
its loader, and each phase's peak read on each memory where the step's timer marks the phase."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from multilane.engine.errors import UserError
from multilane.engine.plan import measure
from torch.utils._pytree import tree_map

RANKED = ("ddp", "fsdp")
"""The strategies of one process per device: probed as one rank, on the first device, at the largest share."""


@contextlib.contextmanager
def rank_group(strategy: str, n: int) -> Any:
    """The probed rank's process group: ddp's, this process alone (Gloo, in memory: DDP's buckets are real);
    fsdp's, rank 0 of ``n`` over torch's ``fake`` backend (collectives that move nothing, so this process
    holds exactly what rank 0 would: its padded shards, the gathered units, the reduce-scatter's buffers)."""
    import torch.distributed as dist

    if strategy not in RANKED:
        yield
        return
    if dist.is_initialized():
        raise UserError(
            f"plan: the {strategy} forecast steps a rank in a process group of its own; this process has one"
        )
    if strategy == "ddp":
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group("fake", rank=0, world_size=n)  # torch registers the backend with its store
    try:
        yield
    finally:
        dist.destroy_process_group()
        if strategy == "fsdp":
            from torch.distributed.tensor.debug import _clear_sharding_prop_cache

            # DTensor's sharding-propagation caches (Python's and the C++ fast path's) key a spec by its
            # mesh, and a mesh's equality ignores the rank: left here, they would hand this probe's rank-0
            # specs to every rank forked from this process later (the ranks' server forks from the launcher),
            # so each rank's shards would claim rank 0's offsets and the first sharded checkpoint fails.
            _clear_sharding_prop_cache()


class LoopStep:
    """The run's own step on ``t`` (a loop with no run folder): its strategy's set-up and ``train_step``,
    the loop's ``optimizer_step``, on the probe's batch; each phase's peak read on each pool where the
    step marks its phases (the timer's marks: the forward ends where the backward is marked, the backward
    and its reduce where the optimizer is, the optimizer and the replicas' sync at the step's end).
    ``rank``: a rank's device and world, whose shard of each global batch the probe's batch is (None: the lanes)."""

    def __init__(
        self, t: Any, count: measure.StorageCount, pools: list, stack: contextlib.ExitStack, rank: Any
    ) -> None:
        self.t, self.count, self.rank = t, count, rank
        self._devices = [torch.device(name) for name, _ in pools] if pools and pools[0][0] != "cpu" else []
        self.setup_peaks: list[int] | None = None
        t.memory = self  # the run's meter's hooks: ``before_model``, ``setup``
        stack.callback(lambda: getattr(t, "backend", None) and t.backend.close())
        self._reset()
        t.setup_parts()
        self.model, self.opt, self.peaks = t.model, t.optimizer, []
        t.timer = _PhaseMarks(t.timer, self._read)
        if not self._devices:
            for x in [*self.model.parameters(), *self.model.buffers()]:
                count.add_tensor(x)  # weights loaded from a file were not made by an op
            stack.enter_context(measure.CpuCounting(count, getattr(t, "backend", None)))

    def before_model(self) -> None:
        """The loop's data is loaded: what is alive now is not the run's."""
        if not self._devices:
            self.count.baseline()

    @contextlib.contextmanager
    def setup(self) -> Any:
        """Around fsdp's sharding, its whole model built (as the rank's meter, meter.py): the setup's peak."""
        if self._devices:
            yield
        else:
            self.count.add_live()
            self.count.reset_peak()
            with measure.CpuCounting(self.count, None):
                yield
        self.setup_peaks = self._peaks()

    def _peaks(self) -> list[int]:
        return measure.cuda_peaks(self._devices) if self._devices else [self.count.peak]

    def _read(self) -> None:
        self.peaks.append(self._peaks())
        self._reset()

    def _reset(self) -> None:
        if self._devices:
            measure.cuda_reset(self._devices)
        else:
            self.count.reset_peak()

    def run(self, inputs: Any, target: Any, b: int) -> list[list[int]]:
        """One step on the first ``b`` samples; each phase's peak (forward, backward, optimizer) on each pool."""
        t = self.t
        device, world = self.rank or (t.backend.model_device, 1)
        t.loader = _Batch(inputs, target, b, device, world)
        self.peaks = []
        self._reset()
        t.spread.train_step(t, 1)
        return self.peaks


class _PhaseMarks:
    """The step's timer, whose marks also end the probe's phases (``LoopStep``)."""

    def __init__(self, timer: Any, read: Any) -> None:
        self.timer, self._read = timer, read

    def mark(self, phase: str | None) -> None:
        if phase in ("backward", "optimizer"):
            self._read()
        self.timer.mark(phase)

    def end_step(self) -> None:
        self._read()
        self.timer.end_step()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.timer, name)


class _Batch:
    """The loop's loader in the probe: the first ``b`` samples of the run's first batch, each step (a rank's
    shard of a batch of ``world`` such shards)."""

    def __init__(self, inputs: Any, target: Any, b: int, device: torch.device, world: int) -> None:
        self.inputs, self.target, self.b, self.device, self.world = inputs, target, b, device, world

    def next(self) -> tuple[Any, Any, int]:
        take = lambda t: t[: self.b].clone().to(self.device) if isinstance(t, torch.Tensor) else t  # noqa: E731
        return tree_map(take, self.inputs), tree_map(take, self.target), self.b

    def next_shard(self) -> tuple[Any, Any, int, int]:
        """A rank's: its shard (the ``b`` samples) of a global batch of ``world`` such shards."""
        return *self.next(), self.b * self.world
