"""The small interface that hides which device layer runs: torch's own on GPUs, CPU lanes elsewhere.

Everything above it (the step strategy, the trainer, the CLI, the app) is shared.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from multilane.engine.parallel.replicas.replica import ReplicaSet
from multilane.engine.parallel.timing import PhaseTimer
from multilane.engine.telemetry.devices import Device, lane_names
from torch import nn


class Backend(ABC):
    """The four primitives of data parallelism, over a fixed list of devices (one replica each)."""

    def __init__(self, devices: Sequence[Device], output_index: int = 0) -> None:
        if not devices:
            raise ValueError("a backend needs at least one device")
        self.devices = list(devices)
        self.lane_names = lane_names(self.devices)
        self.output_index = output_index

    @property
    def n(self) -> int:
        return len(self.devices)

    @property
    def model_device(self) -> torch.device:
        """Where the original parameters live: the first device, as torch's DataParallel wants."""
        return self.devices[0].torch_device()

    @property
    def output_device(self) -> torch.device:
        """Where per-lane losses and outputs are gathered and the combined loss is formed."""
        return self.devices[self.output_index].torch_device()

    @property
    def device_type(self) -> str:
        return self.devices[0].kind

    @abstractmethod
    def scatter(self, obj: Any, sizes: Sequence[int], lanes: Sequence[int]) -> list[Any]:
        """Split the batch ``obj`` along dim 0 into chunks of ``sizes``, one per lane in ``lanes``."""

    @abstractmethod
    def replicate(self, model: nn.Module, lanes: Sequence[int], detach: bool, share: bool = False) -> ReplicaSet:
        """One true replica of ``model`` per lane (engine/parallel/replicas/replica.py: ``replicate_module``): each
        its own tensor for every parameter, listed in ``.params``; gradients of every replica flow back
        to ``model``. ``share``: views instead of copies where a lane sits on the parameters' device."""

    @abstractmethod
    def parallel_apply(
        self,
        fns: Sequence[Callable[..., Any]],
        inputs: Sequence[Any],
        kwargs: Sequence[dict[str, Any]] | None,
        lanes: Sequence[int],
    ) -> list[Any]:
        """Run ``fns[i](*inputs[i], **kwargs[i])`` on lane ``lanes[i]``, all lanes at once."""

    @abstractmethod
    def gather(self, outputs: Sequence[Any]) -> Any:
        """Join per-lane outputs along dim 0 on the output device (differentiable), structure by structure
        (``tree.gather_tree``); an output it cannot join raises ``GatherError`` naming its type."""

    @abstractmethod
    def make_timer(self) -> PhaseTimer:
        """A timer for the phases of a step, read only at log time."""

    def busy(self, lanes: Sequence[int]) -> AbstractContextManager[None]:
        """Count the work inside the block as compute of each of ``lanes`` (their busy %), where the
        backend measures it: work that runs in the calling thread, not parallel_apply (the one-lane
        path; a backward through every lane's graph at once)."""
        return nullcontext()

    def busy_backward(
        self, loss: torch.Tensor | None, lane_losses: Sequence[torch.Tensor], lanes: Sequence[int]
    ) -> AbstractContextManager[None]:
        """Count each lane's part of one backward through several lanes' graphs (run in the calling
        thread: ``replicate``'s one backward) as that lane's busy time, where the backend measures it.
        ``loss``: the tensor backward starts from (None: the lanes' losses themselves); ``lane_losses``:
        each lane's loss in ``lanes``, the root of its own graph."""
        return nullcontext()

    def lane_busy_seconds(self) -> list[float] | None:
        """Compute seconds spent inside each lane so far, where the backend measures it (CPU lanes)."""
        return None

    def close(self) -> None:  # noqa: B027 (optional hook: most backends hold nothing)
        """Release threads or streams the backend holds."""


def make_backend(devices: Sequence[Device], output_index: int = 0) -> Backend:
    """The backend for these devices: torch.nn.parallel on CUDA, CPU lanes on the CPU."""
    if devices and devices[0].is_cuda:
        from multilane.engine.parallel.cuda import CudaBackend

        return CudaBackend(devices, output_index)
    from multilane.engine.parallel.cpu_lanes import CpuLanesBackend

    return CpuLanesBackend(devices, output_index)
