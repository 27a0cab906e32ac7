"""The probe: the run's own steps (the loop's strategy's ``train_step``, whatever the strategy) on the run's
devices at a few small batches, each memory's peak measured (measure.py) in each phase of the step.

The lanes step on every device; ddp and fsdp as one of their ranks, rank 0 of a process group of the
probe's (loop_step.py), on the first device at the largest share. A phase's peak (forward, backward
with the gradient reduce, the optimizer with clipping and the replicas' sync) is read where the step marks
it; the steps measured follow the ones that create what lasts (Adam's moments, persistent replicas) and
the strategy's own first steps (ddp's reach probe), so every one is a steady-state step. Each phase's
points make a broken line in the samples a memory holds. The model and data are the run's; the global
random state is put back afterwards, so a probed run trains exactly as an unprobed one.
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass
from typing import Any

import torch
from multilane.engine.config import RunConfig
from multilane.engine.data.loader import build_loader
from multilane.engine.parallel import chunk_sizes
from multilane.engine.plan import measure
from multilane.engine.plan.loop_step import RANKED, LoopStep, rank_group
from multilane.engine.plan.shards import shard_bytes
from multilane.engine.tasks import Task
from multilane.engine.telemetry.devices import Device

PROBE_PER_DEVICE = (4,)
"""The smallest per-device batch probed; the probe doubles it while the peak's slope still changes."""


@dataclass
class MemoryLine:
    """One memory's need as a function of the samples it holds: the peak of each phase of the step
    (forward, backward, optimizer) measured at a few batches, each phase's points joined by straight
    lines (the last one extended); the need is the highest phase."""

    name: str
    """``cuda:0``, or ``cpu`` (the RAM every CPU lane shares)."""
    lanes: list[int]
    """The run's devices (indices) whose samples this memory holds."""
    phases: dict[str, list[tuple[int, int]]]
    """Each phase's (samples, peak bytes) points, by samples."""
    ranks: int = 1
    """ddp on CPU lanes: the processes (one per lane) whose needs add up in this memory."""
    data_batch: int | None = None
    """The batch a step really takes where the training data holds fewer samples than the run's batch."""
    shards: list[int] | None = None
    """fsdp: [the bytes of parameters, gradients and optimizer state rank 0 holds, one device's whole]."""
    settle: int = 0
    """The strategy's first steps the probe took, unmeasured, after the one that creates what lasts (ddp: its
    reach probe's, whose steps leave DDP's buckets idle): the run's meter measures after them too (meter.py)."""

    @property
    def per_sample(self) -> float:
        """Bytes per sample of the forward's last segment: the activation cost."""
        pts = self.phases["forward"]
        return _slope(pts[-2], pts[-1]) if len(pts) > 1 else 0.0

    def need(self, samples: int) -> int:
        """Bytes at the step's peak with ``samples`` in this memory (per rank for ddp: see ``ranks``)."""
        return max(_along(pts, samples) for pts in self.phases.values())


def first_batch(config: RunConfig, task: Any, batch: int) -> tuple[Any, Any, int]:
    """The run's first batch of ``batch`` samples (inputs, target, how many the data gave), read in this
    process (no loader workers): the largest batch a probe may take."""
    probe_cfg = config.model_copy(deep=True)
    probe_cfg.data.batch_size = batch
    probe_cfg.data.workers = 0
    loader = build_loader(task, probe_cfg, None)
    try:
        loader.start(0, 1)
        return loader.next()
    finally:
        loader.close()


def _along(pts: list[tuple[int, int]], samples: int) -> int:
    """The broken line through ``pts`` at ``samples``: interpolated between points, extended past the last."""
    if len(pts) == 1:
        return pts[0][1]
    k = next((i for i in range(1, len(pts) - 1) if samples <= pts[i][0]), len(pts) - 1)
    (s0, m0), (s1, m1) = pts[k - 1], pts[k]
    return int(max(m1 + _slope((s0, m0), (s1, m1)) * (samples - s1), 0))


def _slope(p0: tuple[int, int], p1: tuple[int, int]) -> float:
    return max(0.0, (p1[1] - p0[1]) / (p1[0] - p0[0])) if p1[0] != p0[0] else 0.0


REPEAT_SHARED = 2
"""CPU lanes share one memory and run at once: how far their backward passes overlap depends on the
threads' timing, so each batch is stepped this many times there and each phase's highest peak kept."""

SETTLED = 0.05
"""The probe doubles the batch until two successive segments' slopes differ by at most this share."""


def probe_batches(batch: int, n: int) -> list[int]:
    """The global batches the probe may take, smallest first: 4, 8, 16... samples per device, doubling
    up to the run's own batch (which ends the list where it is not a doubling)."""
    out = []
    b = PROBE_PER_DEVICE[0] * n
    while b < batch:
        out.append(b)
        b *= 2
    out.append(batch)
    if len(out) == 1 and batch >= 2 * n:  # a small run: its batch and half of it
        out.insert(0, max(n, batch // 2))
    return out


def _whole_shards(batches: list[int], shares: Any) -> list[int]:
    """The probe's batches, each raised (never past the run's, the last) until every device's shard holds
    as many samples as the run's own shard does, up to 2: a probe never steps a device on the one sample
    that no step of the run gives it (BatchNorm refuses a batch of 1: the probe would refuse a run that
    trains)."""
    run = batches[-1]
    need = [min(2, s) for s in shares(run)]
    out = set()
    for b in batches:
        while b < run and any(s < k for s, k in zip(shares(b), need, strict=True)):
            b += 1
        out.add(b)
    return sorted(out)


@contextlib.contextmanager
def _kept_random_state(devices: list[Device]) -> Any:
    """The global random generators as they were: the probe draws nothing the run would."""
    state = random.getstate()
    cuda = sorted({d.index for d in devices if d.is_cuda})
    with torch.random.fork_rng(devices=cuda, device_type="cuda" if cuda else "cpu"):
        yield
    random.setstate(state)


def probe(config: RunConfig, task: Task, devices: list[Device], loop: Any) -> list[MemoryLine]:
    """Measure the run's memory lines (one per memory the run uses); see the module docstring. Where the
    training data holds fewer samples than the batch, the lines' ``data_batch`` says so. ``loop(config, task,
    devices)`` is the loop whose strategy's own set-up and ``train_step`` the probe drives (the lanes'
    ``Trainer.for_probe``, engine/run/trainer.py; a rank's ``probe_loop``, engine/distributed/worker.py): ddp
    and fsdp as one of their ranks, in a process group of the probe's (loop_step.py ``rank_group``)."""
    with _kept_random_state(devices), rank_group(config.devices.strategy, len(devices)):
        return _probe(config, task, devices, loop)


def _probe(config: RunConfig, task: Task, devices: list[Device], loop: Any) -> list[MemoryLine]:
    strategy, n = config.devices.strategy, len(devices)
    ranked = strategy in RANKED
    weights = config.devices.weights or None
    lanes_run = [devices[0]] if ranked else devices  # a rank's step, in this process
    cuda = lanes_run[0].is_cuda
    pools = _pools(lanes_run)
    if ranked:  # one rank holds its own share: probe the largest share
        batches = probe_batches(max(chunk_sizes(config.data.batch_size, n, weights)), 1)
    else:
        batches = probe_batches(config.data.batch_size, n)
    inputs, target, size = first_batch(config, task, batches[-1])  # the data may hold fewer
    # Every step takes all the data there is; a rank's share beyond the data is extended (a forecast above it).
    data_batch = size if size < batches[-1] and not ranked else None
    batches = sorted({min(b, size) for b in batches})

    def shares(b: int) -> list[int]:
        return [b] if ranked else chunk_sizes(b, n, weights)

    batches = _whole_shards(batches, shares)

    count = measure.StorageCount()
    if not cuda:
        count.baseline()  # the data (and all else alive now) is not the run's
    free = [measure.free_bytes(name) for name, _ in pools]
    points: list[tuple[int, list[list[int]]]] = []  # (global batch, each phase's peak on each pool)
    with contextlib.ExitStack() as stack:
        if cuda:
            stack.callback(torch.cuda.empty_cache)  # the last thing done
            if ranked:  # the rank's current device, as its process sets it (FSDP places a rank there)
                stack.enter_context(torch.cuda.device(lanes_run[0].torch_device()))
        stack.callback(torch.set_num_threads, torch.get_num_threads())  # a CPU rank sets its own
        quiet = config.model_copy(deep=True)
        quiet.data.workers = 0  # the loop's own loader is never started: the probe hands it its batches
        if ranked:
            quiet.devices.weights = []  # ... and a rank its share
        rank = (lanes_run[0].torch_device(), n if strategy == "fsdp" else 1) if ranked else None
        step = LoopStep(loop(quiet, task, devices), count, pools, stack, rank)
        step.run(inputs, target, batches[0])  # creates optimizer state, lasting copies
        settle = 0
        while step.t.spread.settling:  # the strategy's first steps (ddp's reach probe): the run's are too
            step.run(inputs, target, batches[0])
            settle += 1
        # The NaN replay's copy of the model and optimizer state (engine/health/nan_origin.py; under
        # ddp each rank's own), held on the model's device for the whole run when it is on: made here
        # too, so every peak holds it.
        replay_copy = _replay_copy(step) if config.health.enabled and config.health.nan_replay else None
        for b in batches:
            if len(points) >= 2 and _beyond(points, b, pools, shares, free):
                break  # the next batch would not fit (or nearly): the line so far says so, without trying
            try:
                peaks = step.run(inputs, target, b)
                for _ in range(REPEAT_SHARED - 1 if not cuda and len(lanes_run) > 1 else 0):
                    again = step.run(inputs, target, b)
                    peaks = [[max(x, y) for x, y in zip(p, q, strict=True)] for p, q in zip(peaks, again, strict=True)]
                points.append((b, peaks))
            except torch.OutOfMemoryError:
                if len(points) < 2:
                    raise
                break  # the points so far are the line (the run's batch is beyond this memory)
            if all(
                _settled(_phase(points, 0, k, ls, shares), _phase(points, 1, k, ls, shares))
                and (not ranked or all(_dominant(_phase(points, i, k, ls, shares)) for i in (0, 1)))
                for k, (_, ls) in enumerate(pools)
            ):
                break
        shards = _shards(step.model, n, config) if strategy == "fsdp" else None
        setup = step.setup_peaks
        del step, replay_copy
    lines = []
    for k, (name, lanes) in enumerate(pools):
        phases = {p: _phase(points, i, k, lanes, shares) for i, p in enumerate(PHASES)}
        if setup is not None:  # fsdp: each rank builds the whole model, then shards it
            phases = {"setup": [(batches[0], setup[k])], **phases}
        if not ranked:
            lines.append(MemoryLine(name, lanes, phases))
            continue
        by_memory: dict[str, list[int]] = {}  # every rank's: each GPU's ranks (two may share one), or the RAM's
        for i, d in enumerate(devices):
            by_memory.setdefault(d.name if d.is_cuda else "cpu", []).append(i)
        lines += [MemoryLine(m, ranks, phases, ranks=len(ranks), shards=shards) for m, ranks in by_memory.items()]
    for line in lines:
        line.data_batch, line.settle = data_batch, settle
    return lines


def _shards(model: torch.nn.Module, n: int, config: RunConfig) -> list[int]:
    """fsdp: [the bytes of parameters, gradients and optimizer state rank 0 holds, one device's whole]
    (shards.py; a sharded parameter's shape is the whole one's)."""
    whole, o = list(model.parameters()), config.optim
    return [shard_bytes(whole, k, 0, o.name, o.momentum).total for k in (n, 1)]


PHASES = ("forward", "backward", "optimizer")


def _replay_copy(step: Any) -> list[torch.Tensor]:
    """A copy of every tensor of the model's and the optimizer's state, as the NaN replay keeps one."""
    from torch.utils._pytree import tree_leaves

    state = [step.model.state_dict(), step.opt.state_dict()]
    return [t.detach().clone() for t in tree_leaves(state) if isinstance(t, torch.Tensor)]


def _phase(points: list, phase: int, pool: int, lanes: list[int], shares: Any) -> list[tuple[int, int]]:
    """One phase's (samples in the pool, peak) points on one pool."""
    return [(sum(shares(b)[i] for i in lanes), peaks[phase][pool]) for b, peaks in points]


def _beyond(points: list, b: int, pools: list, shares: Any, free: list[int | None]) -> bool:
    """Whether batch ``b`` would take a pool past half its free memory, by the lines through ``points``."""
    for k, (_, lanes) in enumerate(pools):
        samples = sum(shares(b)[i] for i in lanes)
        need = max(_along(_phase(points, p, k, lanes, shares), samples) for p in range(len(PHASES)))
        if free[k] is not None and need > PROBE_SHARE * free[k]:
            return True
    return False


PROBE_SHARE = 0.5
"""The probe takes no batch its points say would need more than this share of a memory's free bytes."""


def _settled(forward: list[tuple[int, int]], backward: list[tuple[int, int]]) -> bool:
    """Whether the lines through the points so far will hold at larger batches: each phase's last two
    slopes agree, and the backward's rises at least as fast as the forward's. (At small batches the
    backward's peak can sit where gradients and replica copies meet, flat in the batch; at large ones it
    is its first moments, the forward's activations and their first gradients, rising faster than the
    forward: until that shows, its line would be too low.)"""
    if len(forward) < 3:
        return False
    f0, f1 = _slope(forward[-3], forward[-2]), _slope(forward[-2], forward[-1])
    b0, b1 = _slope(backward[-3], backward[-2]), _slope(backward[-2], backward[-1])
    alike = abs(f1 - f0) <= SETTLED * max(f0, f1, 1e-9) and abs(b1 - b0) <= SETTLED * max(b0, b1, 1e-9)
    return alike and b1 >= (1 - SETTLED) * f1


def _dominant(pts: list[tuple[int, int]]) -> bool:
    """Whether the batch's part of the last point's peak is at least half of it. Until it is, the peak sits
    where the fixed bytes are (a unit's gathered parameters and gradients, the reduce-scatter's buffers),
    whose slope is below the activations' (the MLP at batch 4,096 read -34 % under fsdp, -8 % under ddp,
    from batches 4 to 16 per rank). Asked of the ranked strategies' (ddp, fsdp)."""
    (s0, m0), (s1, m1) = pts[-2], pts[-1]
    return 2 * (m1 - m0) / (s1 - s0) * s1 >= m1


def _pools(devices: list[Device]) -> list[tuple[str, list[int]]]:
    """The memories the lanes use: each GPU (two lanes on one GPU share it), or the CPU's one."""
    if not devices[0].is_cuda:
        return [("cpu", list(range(len(devices))))]
    names: dict[str, list[int]] = {}
    for i, d in enumerate(devices):
        names.setdefault(d.name, []).append(i)
    return list(names.items())
