"""Per-layer health for a training loop Multilane does not drive (Lightning, transformers).

The engine's own sampler (``engine/health/monitor.py``: ``HealthMonitor``) does the work, on the
run's ``health`` section (the same keys and defaults as a native run); this module only maps an outside
loop's hooks onto its calls, for both integrations:

- ``start`` at a step's first micro-batch (a sampled step arms the activation hooks, on the model
  itself: zero cost on other steps, where ``start`` is a modulo test);
- ``micro`` per micro-batch (its samples; under ddp the shares of the noise scale);
- ``gradients`` where the loop's ``.grad`` is the whole optimizer step's gradient, combined over the
  ranks and unscaled, before clipping; ``before_update`` before the optimizer's step and
  ``after_update`` after it (``‖Δw‖/‖w‖``);
- ``end_step`` reads the step's values (one transfer) and returns the ``health`` records and the
  smoothed noise scale.

The noise scale needs each rank's own gradient before the ranks' gradients are combined: under DDP a
communication hook (``engine/health/lane_grads.py``'s ``ddp_comm_hook``, the engine's own) sees this
rank's buckets before torch's all-reduce; ``attach_ddp`` registers it. One process, or a DDP that
already has another communication hook: the noise scale is not measured, and ``note`` says why.
Under FSDP2 (``DTensor`` parameters) ``attach_sharded`` uses the engine's sharded monitor: the
per-layer values from each rank's shards, summed over the ranks, and with one micro-batch per step
the noise scale from each rank's gradient at FSDP's reduce-scatter (engine/health/lane_grads.py: ``probe_reduce_scatter``).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from multilane.engine.config import HealthSection
from multilane.engine.health.lane_grads import ddp_comm_hook
from multilane.engine.health.monitor import ONE_DEVICE, HealthMonitor
from torch import nn

SHARDED = (
    "per-layer health is not recorded under {}: each process holds flat shards of several layers' parameters; "
    "it is under FSDP2 (fully_shard), whose parameters keep their layers"
)
HF_SHARDED = (
    "per-layer health is not recorded under the Trainer's {}: not supported yet (accelerate makes FSDP "
    "on accelerators only, so it was not tested)"
)
SHARDED_NOISE = (
    "the noise scale is not measured under {} with gradient accumulation: FSDP reduce-scatters each rank's "
    "gradient at every micro-batch, so the rank's own gradient of the step never exists whole"
)
HOOK_TAKEN = "the noise scale is not measured: the DDP model already has a communication hook of its own ({})"


def batch_size(batch: Any) -> int:
    """The samples in a batch: the leading size of its first tensor (0 when it has none)."""
    if hasattr(batch, "shape") and len(batch.shape) > 0:
        return int(batch.shape[0])
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for item in items:
        n = batch_size(item)
        if n:
            return n
    return 0


def health_section(health: HealthSection | dict[str, Any] | None) -> HealthSection:
    """The run's ``health`` section: as given, from a dict of its keys, or the defaults (on)."""
    if isinstance(health, HealthSection):
        return health
    return HealthSection.model_validate(health or {})


class LoopHealth:
    """The health of one process's part of an outside trainer's run."""

    def __init__(self, cfg: HealthSection, device: torch.device | str, rank: int = 0, world: int = 1) -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        self.rank, self.world = rank, world
        self.monitor = HealthMonitor(cfg, 1, self.device)
        self.note: str | None = ONE_DEVICE if cfg.enabled and world < 2 else None
        self.accum = 1
        self._took = False  # this sampled step's gradients were read

    @property
    def every(self) -> int:
        """The cadence (0: off)."""
        return self.monitor.every

    @property
    def on(self) -> bool:
        """This step is sampled (between ``start`` and ``after_update``)."""
        return self.monitor.on

    def switch_off(self, reason: str) -> None:
        """No health in this run (a sharded strategy: a process's ``.grad`` is not the layer's)."""
        self.monitor.every = 0
        self.note = reason

    @property
    def measures_noise(self) -> bool:
        """The noise scale is measured (each rank's gradient caught before the ranks combine them)."""
        return self.monitor.probe is not None and self.world > 1

    def drop_noise(self, reason: str) -> None:
        """No noise scale from here on (before the step's first backward; every rank alike)."""
        if self.monitor.probe is not None:
            self.monitor.probe.disarm()
            self.monitor.probe = None
        self.note = reason

    def attach_sharded(self, model: nn.Module, strategy: str, accum: int) -> None:
        """Under FSDP2 (``DTensor`` parameters): per-layer health from each rank's shards, summed over
        the ranks (the engine's sharded monitor), and with one micro-batch per step the noise scale
        from each rank's gradient as FSDP's reduce-scatter receives it (``probe_reduce_scatter``); else ``note`` says
        why not. Every rank calls it, before the first backward."""
        if not self.every:
            return
        import torch.distributed as dist
        from multilane.engine.health.lane_grads import probe_reduce_scatter

        lanes = self.world if accum == 1 else 1  # one lane: no probe, the per-layer sums only
        monitor = HealthMonitor(self.cfg, lanes, self.device, exchange=dist.all_reduce, sharded=True)
        self.monitor, self.note = monitor, None
        if accum > 1:
            self.note = SHARDED_NOISE.format(strategy)
            return
        assert monitor.probe is not None
        why = probe_reduce_scatter(model, monitor.probe, self.rank, self.world)
        if why is not None:
            monitor.probe = None
            self.note = f"the noise scale is not measured under {strategy}: {why}"

    def attach_ddp(self, ddp: Any) -> None:
        """Under ddp: this rank's gradient, before the all-reduce, for the noise scale (every rank calls
        it, before the first backward). A DDP with a communication hook of its own keeps it: then no
        noise scale, and ``note`` says why."""
        if not self.every or self.world < 2:
            return
        import torch.distributed as dist

        monitor = HealthMonitor(self.cfg, self.world, self.device, exchange=dist.all_reduce)
        assert monitor.probe is not None
        try:
            ddp.register_comm_hook(None, ddp_comm_hook(monitor.probe, self.rank, self.world))
        except RuntimeError as e:
            self.note = HOOK_TAKEN.format(str(e).splitlines()[0] if str(e) else type(e).__name__)
            return
        self.monitor, self.note = monitor, None

    # -- the step ---------------------------------------------------------------------------------
    def start(self, step: int, model: nn.Module, accum: int) -> None:
        """Before step ``step``'s (1-based) first micro-batch."""
        self.accum = max(1, int(accum))
        self._took = False
        self.monitor.begin_step(step, model, self.accum)

    def micro(self, samples: int) -> None:
        """One micro-batch of ``samples`` on this rank. Under DDP every rank's loss is its own batch's
        mean and the ranks' gradients are averaged: each sample weighs ``1 / (world · samples · accum)``."""
        if self.monitor.on and samples > 0:
            lane = self.rank if self.monitor.lanes > 1 else 0  # one lane: no noise scale, the shares unused
            self.monitor.micro([float(samples)], [lane], self.accum, samples * self.world)

    def gradients(self, model: nn.Module, scale: torch.Tensor | float | None = None, lane_scale: Any = None) -> None:
        """``model``'s ``.grad`` is the step's gradient (every micro-batch's, the ranks' combined).
        ``scale``: the loss scale ``.grad`` still carries (None: unscaled); ``lane_scale``: the one the
        communication hook saw (fp16 under ddp, where the loop unscales ``.grad`` before its hook)."""
        if self.monitor.on and not self._took:
            s = None if scale is None else torch.as_tensor(scale, dtype=torch.float64)
            self.monitor.after_reduce(model, s, lane_scale)
            self._took = True

    @property
    def took_gradients(self) -> bool:
        """This sampled step's gradients were read (later calls of ``gradients`` leave them)."""
        return self._took

    def before_update(self) -> None:
        if self._took:
            self.monitor.before_update()

    def after_update(self) -> None:
        """After the optimizer's step; a sampled step whose gradients were never read is dropped."""
        if self.monitor.on and not self._took:
            self.monitor.abandon()
            return
        self.monitor.after_update()
        self._took = False

    def abandon(self) -> None:
        """The step did not reach the optimizer (skipped, failed): drop what it armed."""
        self.monitor.abandon()

    def end_step(self) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
        """``(noise, records)``: the smoothed noise scale (None if not measured) and the sampled
        steps' ``health`` records. Under ddp a collective when a step was sampled: every rank calls it.
        The noise scale's measured steps wait on the device until then (no read per step)."""
        return self.monitor.at_log(time.time(), read=False)
