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
from multilane.engine.parallel.strategy import AUTOCAST_DTYPES
from multilane.engine.plan import measure
from multilane.engine.plan.probe import Stepper
from multilane.engine.tasks import Task
from multilane.engine.telemetry.devices import Device


class RankStepper(Stepper):
    """``Stepper`` whose forward and backward are a ddp rank's (see the module docstring)."""

    def __init__(self, config: RunConfig, task: Task, backend: Any, count: measure.StorageCount, pools: list) -> None:
        super().__init__(config, task, backend, count, pools)
        self.rules = RankRules(self.model, self.device, 1, None)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.dtype = AUTOCAST_DTYPES.get(config.train.precision)
        self._sync = contextlib.ExitStack()
        self._build(False)

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
