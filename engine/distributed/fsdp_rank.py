"""The fsdp strategy: the ddp strategy with the model sharded by FSDP2 (engine/fsdp/) instead of replicated.

Everything but the model is the ddp rank's (``ddp.py``): the shards of each
global micro-batch, the loss scaled so that the gradient average is the full-batch gradient, the
random streams, the buffer merge, pause/stop agreement, telemetry, the log window. What differs:

- the model is ``fully_shard``-ed per unit (``engine/fsdp/units.py``); each rank keeps 1/N of every parameter,
  gradient and optimizer state, and the optimizer steps on its shards;
- gradients are reduce-scattered (averaged, as DDP's all-reduce) once per optimizer step: the
  micro-batches before the last accumulate unreduced (``set_requires_gradient_sync(False)``);
- ``train.grad_clip`` clips by the global norm over every rank's shards
  (``clip_grad_norm_`` on DTensor gradients reduces the norm across the ranks);
- evaluation gathers the whole parameters once (``unshard``) and frees them after, so the ranks can
  each run their own slice and rank 0 the task's text sample without a collective per forward;
- checkpoints are sharded (``engine/fsdp/sharded.py``);
- optionally each unit recomputed in backward, and the shards kept in host memory (``units.py``);
- run health sums each rank's shards (engine/health, ``sharded``) and reads each rank's gradient at
  the reduce-scatter (``probe_reduce_scatter``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch
from multilane.engine.distributed.ddp import Ddp
from multilane.engine.distributed.window import ShardWindow
from multilane.engine.fsdp.reach import REACH_STEPS, UnitGuard, no_double_backward
from multilane.engine.fsdp.sharded import remove_older, save_sharded
from multilane.engine.fsdp.units import ViewOutputs, choose_units, parameters_read_in_forward, shard_model
from multilane.engine.health.lane_grads import probe_reduce_scatter
from multilane.engine.run import checkpointer
from torch import nn

if TYPE_CHECKING:
    from multilane.engine.run.trainer import Trainer


class _Sharded:
    """What the ddp strategy calls ``self.ddp``: the sharded model, and ``no_sync`` as FSDP2 spells it."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self.model.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)  # type: ignore[operator]


class _FsdpWindow(ShardWindow):
    def add_grad_norm(self, norm: torch.Tensor) -> None:
        full = getattr(norm, "full_tensor", None)  # a DTensor: the norm over every rank's shards
        super().add_grad_norm(full() if full is not None else norm)


class Fsdp(Ddp):
    """The ddp strategy with the model sharded (see the module docstring)."""

    sharded = True  # checkpointer.restore loads any checkpoint through the state-dict helpers

    def setup(self, t: Trainer) -> None:
        cfg, info = t.config, self.info
        from torch.distributed.device_mesh import init_device_mesh

        dev = self._setup_rank(t)
        # the setup's peak (the whole model and the first shards), a phase of the forecast (plan/meter.py)
        with t.memory.setup() if t.memory is not None else contextlib.nullcontext():
            mesh = init_device_mesh(dev.type, (info.world,))
            self.units = shard_model(
                t.model,
                choose_units(t.task, t.model),
                cfg.train.precision,
                mesh,
                activation_checkpointing=cfg.devices.fsdp_activation_checkpointing,
                cpu_offload=cfg.devices.fsdp_cpu_offload,
                device=dev,
            )
        # The ranks agree on each unit before its all-gather during this process's first steps (reach.py)
        self.unit_guard = UnitGuard(t.model, self.units, self.control_group)
        self._guard_steps = REACH_STEPS
        self.views = ViewOutputs([*self.units, t.model])
        self._setup_common(t, dev, "fsdp")
        t.scaler = torch.amp.GradScaler(info.device.kind, enabled=False)  # fp16 is refused (units.py)
        t.window = _FsdpWindow()
        self.autocast_dtype = None  # FSDP2's MixedPrecisionPolicy casts (units.py)

    def health_spread(self, t: Trainer) -> dict[str, Any]:
        # Health from the shards (each rank's sums added at log time), the noise scale from each rank's
        # gradient before the reduce-scatter, and a NaN's replay on every rank (docs/fsdp.md "Run health").
        return {**super().health_spread(t), "sharded": True}

    def attach(self, t: Trainer) -> None:
        info = self.info
        self._restore(t, info.device.torch_device())
        self.rules.reached = None  # no DDP probe: FSDP reduces what the ranks' backwards reach
        self.rules.before_backward = self.unit_guard.before_backward  # ... which must be alike (reach.py)
        health = t.health
        why = probe_reduce_scatter(t.model, health.probe, info.rank, info.world) if health.probe else None
        if why is not None:  # this torch has no such hook: no noise scale, and the run says why
            health.probe = None
            health.off_note = f"the noise scale is not available under fsdp with this torch: {why}"
        self.ddp = _Sharded(t.model)
        self._find_unused = True  # an empty shard's zero loss goes through the outputs only
        self._gather_keys()

    def train_step(self, t: Trainer, accum: int) -> None:
        self.unit_guard.active = self._guard_steps > 0
        try:
            # a forward reading parameters outside its unit may meet the DTensor in its backward: one line
            with parameters_read_in_forward(), no_double_backward() if self.unit_guard.active else nullcontext():
                super().train_step(t, accum)
        finally:
            self.unit_guard.active = False
            self._guard_steps -= 1

    def _forward(
        self, t: Trainer, inputs: Any, target: Any, n: int
    ) -> tuple[Any, torch.Tensor | None, torch.Tensor | None]:
        with parameters_read_in_forward():
            if n == 0:  # an empty shard: the model runs on a stand-in sample, which is not the batch's
                with t.health.no_activations():
                    out = super()._forward(t, inputs, target, n)
            else:
                out = super()._forward(t, inputs, target, n)
        self.views.check()  # no unit's view output changed in place (units.py: FSDP2's view warning)
        return out

    # -- checkpoints ----------------------------------------------------------------------------
    def checkpoint_state(self, t: Trainer) -> dict[str, Any]:
        """Every rank writes its shards (DCP); ``last.pt`` (rank 0) holds the rest and the folder's name."""
        assert t.run_dir is not None
        folder = t.run_dir.path / "checkpoints"
        self._saving = save_sharded(t.model, t.optimizer, folder, t.step, self.info.is_main)
        state = checkpointer.checkpoint_state(t)  # the rest as every strategy writes it
        return {**state, "model": {}, "optimizer": {}, "sharded": self._saving}

    def checkpoint_saved(self, t: Trainer) -> None:
        """``last.pt`` names the new folder: rank 0 removes the older ones."""
        if self.info.is_main and t.run_dir is not None:
            remove_older(t.run_dir.path / "checkpoints", self._saving)

    # -- evaluation -----------------------------------------------------------------------------
    def evaluate(self, t: Trainer) -> None:
        """The parameters gathered whole once for the whole evaluation (a collective on every rank),
        then the ddp rank's evaluation of its slices, then freed."""
        if not t.loader.has_val:
            return
        fsdp_modules = [m for m in t.model.modules() if hasattr(m, "unshard")]
        for m in fsdp_modules:
            m.set_reshard_after_forward(False, recurse=False)  # type: ignore[operator]
            m.unshard()  # type: ignore[operator]
        try:
            super().evaluate(t)
        finally:
            for m in fsdp_modules:
                m.reshard()  # type: ignore[operator]
                m.set_reshard_after_forward(m is not t.model, recurse=False)  # type: ignore[operator]
