"""The GPU backend: a thin layer over torch.nn.parallel's own scatter, replicate, parallel_apply, gather."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from multilane.engine.parallel.backend import Backend
from multilane.engine.parallel.timing import CudaPhaseTimer, PhaseTimer
from multilane.engine.parallel.tree import scatter_tree
from torch import nn
from torch.nn.parallel import gather, parallel_apply, replicate
from torch.nn.parallel._functions import Scatter


class CudaBackend(Backend):
    def __init__(self, devices, output_index: int = 0) -> None:
        super().__init__(devices, output_index)
        self._indices = [d.index for d in self.devices]

    def scatter(self, obj: Any, sizes: Sequence[int], lanes: Sequence[int]) -> list[Any]:
        # torch's scatter() splits evenly only; Scatter.apply takes chunk sizes (uneven splits).
        gpus = [self._indices[i] for i in lanes]
        chunks = list(sizes)
        return scatter_tree(obj, len(lanes), lambda t: Scatter.apply(gpus, chunks, 0, t))

    def replicate(self, model: nn.Module, lanes: Sequence[int], detach: bool) -> list[nn.Module]:
        if list(lanes) == [0]:
            return [model]  # one replica on the model's own device: nothing to copy (as DataParallel does)
        gpus = [self._indices[i] for i in lanes]
        if lanes[0] != 0:
            # torch's replicate broadcasts from its first device, which must hold the model ("All
            # tensors must be on devices[0]"): start from the model's device and drop that replica
            # (lane 0 sits this step out, e.g. devices.weights = [0, 1]).
            return replicate(model, [self._indices[0], *gpus], detach=detach)[1:]
        return replicate(model, gpus, detach=detach)

    def parallel_apply(
        self,
        fns: Sequence[Callable[..., Any]],
        inputs: Sequence[Any],
        kwargs: Sequence[dict[str, Any]] | None,
        lanes: Sequence[int],
    ) -> list[Any]:
        return parallel_apply(fns, inputs, kwargs, [self._indices[i] for i in lanes])  # type: ignore[arg-type]

    def gather(self, outputs: Sequence[Any]) -> Any:
        return gather(outputs, self._indices[self.output_index], dim=0)

    def make_timer(self) -> PhaseTimer:
        return CudaPhaseTimer(self.output_device)
