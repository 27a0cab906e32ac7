"""The GPU backend: torch.nn.parallel's own scatter, parallel_apply and gather; the engine's true replicas.

Replication is the one primitive not taken from torch: ``replicate_module`` (engine/parallel/replicas/replica.py)
is the same code the CPU lanes run, so both backends give every lane a private copy of each parameter,
visible through ``.parameters()``, with the same gradient semantics. Gather is ``gather_tree`` over
torch's differentiable ``Gather``: the same structures (dataclasses, 0-dim tensors) as on CPU lanes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from multilane.engine.parallel.backend import Backend
from multilane.engine.parallel.replicas.replica import ReplicaSet, replicate_module
from multilane.engine.parallel.timing import CudaPhaseTimer, PhaseTimer
from multilane.engine.parallel.tree import gather_tree, move_tree, scatter_tree
from torch import nn
from torch.nn.parallel import parallel_apply
from torch.nn.parallel._functions import Gather, Scatter


class CudaBackend(Backend):
    def __init__(self, devices, output_index: int = 0) -> None:
        super().__init__(devices, output_index)
        self._indices = [d.index for d in self.devices]

    def scatter(self, obj: Any, sizes: Sequence[int], lanes: Sequence[int]) -> list[Any]:
        # torch's scatter() splits evenly only; Scatter.apply takes chunk sizes (uneven splits).
        gpus = [self._indices[i] for i in lanes]
        chunks = list(sizes)
        return scatter_tree(obj, len(lanes), lambda t: Scatter.apply(gpus, chunks, 0, t))

    def replicate(self, model: nn.Module, lanes: Sequence[int], detach: bool, share: bool = False) -> ReplicaSet:
        devices = [torch.device("cuda", self._indices[i]) for i in lanes]
        # Every lane updates copies of the buffers; the step merges them into the model (buffers.py).
        return replicate_module(model, devices, detach, None, share)

    def parallel_apply(
        self,
        fns: Sequence[Callable[..., Any]],
        inputs: Sequence[Any],
        kwargs: Sequence[dict[str, Any]] | None,
        lanes: Sequence[int],
    ) -> list[Any]:
        return parallel_apply(fns, inputs, kwargs, [self._indices[i] for i in lanes])  # type: ignore[arg-type]

    def gather(self, outputs: Sequence[Any]) -> Any:
        target = self._indices[self.output_index]
        if len(outputs) == 1:  # one lane took part: its output as it is (as on CPU lanes), moved over
            return move_tree(outputs[0], self.output_device)
        return gather_tree(outputs, lambda ts: Gather.apply(target, 0, *ts))

    def make_timer(self) -> PhaseTimer:
        return CudaPhaseTimer(self.output_device)
