"""The ddp probe's step: one rank's step as the ddp strategy takes it (engine/distributed/ddp.py), on this
process's group of one, each phase's peak measured as probe.py measures every strategy's.

The trainer's own pieces drive it, so that what a rank trains the probe measures: the rank's forward by
the ranks' rules (``RankRules.forward``: buffers merged, a forward that writes a parameter in place
refused), its shard's loss (``shard_forward``, in the run's autocast), DDP built as the trainer builds it
(``build_ddp``), and the first steps' probe of the parameters the backward reaches (under ``no_sync``,
then ``reduce_probe``), after which DDP is rebuilt with ``find_unused_parameters`` when some parameter
was not reached: a layer only some samples use (a data-dependent branch, an expert no sample picks)
trains in the probe as in the run. A probe batch past those steps whose backward misses a parameter
the earlier ones reached is run again with ``find_unused_parameters`` (its forward repeated), as the
run's ranks may need it where their shards differ from the probe's.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
from multilane.engine.config import RunConfig
from multilane.engine.distributed.rank_state import RankRules, build_ddp, reached, shard_forward
from multilane.engine.parallel import make_backend
from multilane.engine.parallel.strategy import AUTOCAST_DTYPES
from multilane.engine.plan import measure
from multilane.engine.tasks import Task, loss_weight_fn
from multilane.engine.telemetry.devices import Device
from multilane.engine.tensors.grads import clip_grad_norm
from multilane.engine.tensors.optim import build_optimizer
from torch.utils._pytree import tree_map


class RankStepper:
    """A ddp rank's step (see the module docstring) on one device, each phase's peak measured."""

    def __init__(self, config: RunConfig, task: Task, backend: Any, count: measure.StorageCount, pools: list) -> None:
        self.cfg, self.task, self.count = config, task, count
        torch.manual_seed(config.train.seed)
        self.device = backend.model_device
        self.model = task.build_model().to(self.device)
        if self.device.type != "cuda":
            for t in [*self.model.parameters(), *self.model.buffers()]:
                count.add_tensor(t)  # weights loaded from a file were not made by an op
        self.opt = build_optimizer(self.model.parameters(), config.optim)
        self.scaler = torch.amp.GradScaler(backend.device_type, enabled=config.train.precision == "fp16")
        self.weight_fn = loss_weight_fn(task)
        self._devices = [torch.device(name) for name, _ in pools] if self.device.type == "cuda" else []
        self.rules = RankRules(self.model, self.device, 1, None)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.dtype = AUTOCAST_DTYPES.get(config.train.precision)
        self._sync = contextlib.ExitStack()
        self._build(False)

    def _reset(self) -> None:
        if self._devices:
            measure.cuda_reset(self._devices)
        else:
            self.count.reset_peak()

    def _peaks(self) -> list[int]:
        return measure.cuda_peaks(self._devices) if self._devices else [self.count.peak]

    def run(self, inputs: Any, target: Any, b: int, sizes: list[int]) -> list[list[int]]:
        """One step on the first ``b`` samples; each phase's peak (forward, backward, optimizer) on each pool."""
        self._reset()
        take = lambda t: t[:b].clone().to(self.device) if isinstance(t, torch.Tensor) else t  # noqa: E731
        x, y = tree_map(take, inputs), tree_map(take, target)
        out = self.forward(x, y, sizes)
        forward = self._peaks()
        self._reset()
        self.opt.zero_grad(set_to_none=True)
        self.backward(out)
        del out, x, y
        backward = self._peaks()
        self._reset()
        if self.cfg.train.grad_clip > 0:
            self.scaler.unscale_(self.opt)
            clip_grad_norm(self.model.parameters(), self.cfg.train.grad_clip)
        self.scaler.step(self.opt)
        self.scaler.update()
        return [forward, backward, self._peaks()]

    def _build(self, find_unused: bool) -> None:
        self.ddp = None  # the old DDP (and its reducer's hooks) goes first
        self.ddp = build_ddp(self.model, Device(self.device.type, self.device.index or 0), find_unused)
        self.find_unused = find_unused

    def _forward(self, x: Any, y: Any, n: int, sizes: list[int]) -> tuple[Any, torch.Tensor]:
        fwd = functools.partial(
            shard_forward, self.ddp, self.task, self.weight_fn, self.device.type, self.dtype, x, y, n
        )
        output, loss, _ = self.rules.forward(fwd, n, sizes)
        return output, loss

    def forward(self, x: Any, y: Any, sizes: list[int]) -> Any:
        n = sizes[0]
        if self.rules.reached is not None:  # the first steps: DDP reduces nothing, the rules note what they reach
            self._sync.enter_context(self.ddp.no_sync())
        output, loss = self._forward(x, y, n, sizes)
        if self.rules.reached is None and not self.find_unused:
            seen = reached(loss)
            if not all(id(p) in seen for p in self.params):  # DDP would wait for a gradient that never comes
                del output, loss
                self._build(True)
                self._reset()
                output, loss = self._forward(x, y, n, sizes)
        return output, loss

    def backward(self, out: Any) -> None:
        _, loss = out
        self.rules.note(loss)
        try:
            self.scaler.scale(loss).backward()
        finally:
            self._sync.close()
        if self.rules.reached is not None and self.rules.reduce_probe():
            self._build(True)


def rank_stepper(
    config: RunConfig, task: Task, device: Device, count: measure.StorageCount, pools: list, stack: contextlib.ExitStack
) -> RankStepper:
    """One ddp rank's step on ``device``, on this process's group of one (closed by ``stack``)."""
    stack.enter_context(_one_rank_group())
    backend = make_backend([device], 0)
    stack.callback(backend.close)
    if not device.is_cuda:
        stack.enter_context(measure.CpuCounting(count, backend))
    return RankStepper(config, task, backend, count, pools)


@contextlib.contextmanager
def _one_rank_group() -> Any:
    """A process group of this process alone (Gloo, in memory), for DDP's buckets to be real."""
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
