"""The probe for the ``fsdp`` strategy: one rank of the run, simulated in this process, its memory measured.

An fsdp rank holds 1/N of every parameter, gradient and optimizer state (``shards.py``: FSDP2's rule)
plus, for a moment, the units FSDP gathers whole for their forward and backward, plus its own share of
the batch's activations. Rather than add these up from a model of FSDP's buffers, the probe runs them:
the run's model is ``fully_shard``-ed by the trainer's own code (``engine/fsdp/units.py``: the same units,
precision policy, activation checkpointing and CPU offload) as rank 0 of an N-rank process group of
torch's ``fake`` backend (``torch.distributed.Backend.FAKE``: collectives that move nothing, so one process
holds exactly what rank 0 would: its padded shards, each all-gather's output buffer and unsharded
parameters, each reduce-scatter's input and output), and steps it as the fsdp trainer does (forward,
``zero_grad``, backward with its reduce-scatters, clipping, the optimizer) at a few batches of the largest
rank's share, each phase's peak measured (measure.py). Rank 0 holds the largest shards (torch.chunk puts
the remainder rows first; the shards of parameters and gradients are padded to rank 0's size on every
rank), so its need with the largest share bounds every rank's.

The fake all-gather leaves the other ranks' rows of a gathered parameter as they were allocated: the
probe computes with whatever they hold (its losses mean nothing; the memory a step allocates does not
depend on the values). A model whose control flow depends on its parameters' values (a router) could
allocate differently there. Setup (each rank builds the whole model, then shards it) is a phase of its
own: a rank's memory holds the whole model before ``fully_shard`` frees it.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
from multilane.engine.config import RunConfig
from multilane.engine.distributed.rank_state import RankRules, shard_forward
from multilane.engine.errors import UserError
from multilane.engine.fsdp.reach import no_double_backward
from multilane.engine.parallel import chunk_sizes
from multilane.engine.plan import measure
from multilane.engine.plan.probe import (
    PROBE_SHARE,
    MemoryLine,
    _along,
    _dominant,
    _kept_random_state,
    _replay_copy,
    _settled,
    first_batch,
    probe_batches,
)
from multilane.engine.plan.shards import shard_bytes
from multilane.engine.tasks import loss_weight_fn
from multilane.engine.telemetry.devices import Device
from multilane.engine.tensors.grads import clip_grad_norm
from multilane.engine.tensors.optim import build_optimizer
from torch.utils._pytree import tree_map

FSDP_PHASES = ("setup", "forward", "backward", "optimizer")


def probe_fsdp(config: RunConfig, task: Any, devices: list[Device]) -> list[MemoryLine]:
    """Each memory's line for an fsdp run on ``devices`` (one rank each): each GPU's, or the RAM's every CPU
    rank shares, ``ranks`` being the ranks whose needs add up in it."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        raise UserError("plan: the fsdp forecast simulates a rank in its own process group; this process has one")
    with _kept_random_state(devices), _fake_group(len(devices)):
        phases, data_batch, shards = _probe(config, task, devices)
    by_memory: dict[str, list[int]] = {}  # each GPU's ranks (two ranks may share one), or the RAM's
    for i, d in enumerate(devices):
        by_memory.setdefault(d.name if d.is_cuda else "cpu", []).append(i)
    lines = [MemoryLine(name, lanes, phases, ranks=len(lanes)) for name, lanes in by_memory.items()]
    for line in lines:
        line.data_batch, line.shards = data_batch, shards
    return lines


@contextlib.contextmanager
def _fake_group(n: int) -> Any:
    """This process as rank 0 of ``n`` over torch's ``fake`` backend (no other process, nothing sent)."""
    import torch.distributed as dist
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    dist.init_process_group("fake", rank=0, world_size=n)  # torch registers the backend with its store
    try:
        yield
    finally:
        dist.destroy_process_group()
        # DTensor's sharding-propagation caches (Python's and the C++ fast path's) key a spec by its
        # mesh, and a mesh's equality ignores the rank: left here, they would hand this probe's rank-0
        # specs to every rank forked from this process later (the ranks' server forks from the launcher),
        # so each rank's shards would claim rank 0's offsets and the first sharded checkpoint fails.
        _clear_sharding_prop_cache()


def _probe(config: RunConfig, task: Any, devices: list[Device]) -> tuple[dict[str, Any], int | None, list[int]]:
    n = len(devices)
    share = max(chunk_sizes(config.data.batch_size, n, config.devices.weights or None))
    batches = probe_batches(share, 1)
    inputs, target, size = first_batch(config, task, batches[-1])
    # Data that holds fewer samples than a rank's share: the line is extended to the share (as ddp's probe
    # does), a forecast above what such a run takes.
    data_batch = None
    batches = sorted({min(b, size) for b in batches})
    dev = devices[0].torch_device()
    count = measure.StorageCount()
    if not devices[0].is_cuda:
        count.baseline()
    points: dict[str, list[tuple[int, int]]] = {p: [] for p in FSDP_PHASES}
    # FSDP places a rank on the current CUDA device (as the rank's own process has set it)
    counting = measure.CpuCounting(count, None) if not devices[0].is_cuda else torch.cuda.device(dev)
    with counting:
        step = _RankStepper(config, task, dev, n, count)  # measures the setup phase
        step.run(inputs, target, batches[0])  # creates the optimizer's state
        # Each rank's NaN replay copy of its shards and optimizer state (engine/health/nan_origin.py),
        # held for the whole run when it is on: made here too, so every peak holds it.
        replay_copy = _replay_copy(step) if config.health.enabled and config.health.nan_replay else None
        free = measure.free_bytes(devices[0].name)
        for b in batches:
            if free is not None and len(points["forward"]) >= 2 and _need(points, b) > PROBE_SHARE * free:
                break  # the next batch would take this memory past half its free bytes: the line so far says so
            try:
                peaks = step.run(inputs, target, b)
            except torch.OutOfMemoryError:
                if len(points["forward"]) < 2:
                    raise
                break
            for p, v in zip(FSDP_PHASES[1:], peaks, strict=True):
                points[p].append((b, v))
            if _settled(points["forward"], points["backward"]) and all(_dominant(points[p]) for p in FSDP_PHASES[1:3]):
                break
        points["setup"] = [(batches[0], step.setup_peak)]
        shards = step.shards
        del step, replay_copy
    if devices[0].is_cuda:
        torch.cuda.empty_cache()
    return points, data_batch, shards


def _need(points: dict[str, list[tuple[int, int]]], b: int) -> int:
    return max(_along(points[p], b) for p in FSDP_PHASES[1:])


class _RankStepper:
    """The fsdp trainer's step on one rank (engine/distributed/fsdp_rank.py, ddp.py): its
    forward by the trainer's own ``RankRules.forward`` and ``shard_forward``."""

    def __init__(self, config: RunConfig, task: Any, dev: torch.device, n: int, count: measure.StorageCount) -> None:
        from multilane.engine.fsdp.units import ViewOutputs, choose_units, shard_model
        from torch.distributed.device_mesh import init_device_mesh

        self.cfg, self.task, self.dev, self.count = config, task, dev, count
        self._reset()
        torch.manual_seed(config.train.seed)
        self.model = task.build_model().to(dev)
        if dev.type != "cuda":
            for t in [*self.model.parameters(), *self.model.buffers()]:
                count.add_tensor(t)  # weights loaded from a file were not made by an op
        whole = list(self.model.parameters())
        o = config.optim
        self.shards = [
            shard_bytes(whole, n, 0, o.name, o.momentum).total,
            shard_bytes(whole, 1, 0, o.name, o.momentum).total,
        ]
        del whole
        mesh = init_device_mesh(dev.type, (n,))
        units = shard_model(
            self.model,
            choose_units(task, self.model),
            config.train.precision,
            mesh,
            activation_checkpointing=config.devices.fsdp_activation_checkpointing,
            cpu_offload=config.devices.fsdp_cpu_offload,
            device=dev,
        )
        self.views = ViewOutputs([*units, self.model])  # as the trainer: a view changed in place is refused
        self.opt = build_optimizer(self.model.parameters(), config.optim)
        self.setup_peak = self._peak()
        # The rank's forward as the trainer takes it: the ranks' rules (buffers merged over the fake group)
        # and the shard's loss (the task's inputs as the model takes them, its loss and weight checked).
        self.rules = RankRules(self.model, dev, n, None)
        self.rules.reached = None
        self.n, self.weight_fn = n, loss_weight_fn(task)

    def _reset(self) -> None:
        if self.dev.type == "cuda":
            measure.cuda_reset([self.dev])
        else:
            self.count.reset_peak()

    def _peak(self) -> int:
        return measure.cuda_peaks([self.dev])[0] if self.dev.type == "cuda" else self.count.peak

    def run(self, inputs: Any, target: Any, b: int) -> list[int]:
        """One step on the first ``b`` samples: each phase's peak (forward, backward, optimizer)."""
        take = lambda t: t[:b].clone().to(self.dev) if isinstance(t, torch.Tensor) else t  # noqa: E731
        x, y = tree_map(take, inputs), tree_map(take, target)
        self._reset()
        fwd = functools.partial(shard_forward, self.model, self.task, self.weight_fn, self.dev.type, None, x, y, b)
        from multilane.engine.fsdp.units import parameters_read_in_forward

        # a gradient penalty, parameters read in the forward: refused in one line, as the run would be
        with no_double_backward(), parameters_read_in_forward():
            out, loss, _ = self.rules.forward(fwd, b, [b] * self.n)
        self.views.check()
        forward = self._peak()
        self._reset()
        self.opt.zero_grad(set_to_none=True)
        with parameters_read_in_forward():  # such a forward may meet the DTensor only in its backward
            loss.backward()
        del out, loss, x, y
        backward = self._peak()
        self._reset()
        if self.cfg.train.grad_clip > 0:
            clip_grad_norm(self.model.parameters(), self.cfg.train.grad_clip)
        self.opt.step()
        return [forward, backward, self._peak()]
