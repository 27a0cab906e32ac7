"""CPU lanes: N virtual devices on the CPU, each replica in its own thread, where a GPU replica would run.

torch 2.13's scatter/replicate/gather refuse CPU tensors and parallel_apply needs an accelerator, so
these are the same four primitives for the CPU, with the same semantics:

- scatter splits along dim 0 (views, no copy: every lane shares the one CPU memory);
- replicate gives every lane a true replica (engine/parallel/replicas/replica.py): its own differentiable copy
  of each parameter, whose gradients are summed back into the original parameters (as Broadcast's
  backward does) and its own copy of each buffer, which the step merges back into the model
  (engine/parallel/replicas/buffers.py: the sample-weighted mean of the lanes'), as on GPUs;
- parallel_apply runs replica i in lane i's own thread and re-raises a failure as
  "Caught X in replica i on device cpu:i", exactly like torch;
- gather concatenates along dim 0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import Any

import torch
from multilane.engine.parallel.backend import Backend
from multilane.engine.parallel.replicas.replica import ReplicaSet, is_lane_copies, replicate_module
from multilane.engine.parallel.timing import PhaseTimer
from multilane.engine.parallel.tree import gather_tree, scatter_tree
from multilane.engine.telemetry.busy import BackwardShares, BusyClock
from torch import nn
from torch._utils import ExceptionWrapper


class CpuLanesBackend(Backend):
    def __init__(self, devices, output_index: int = 0) -> None:
        super().__init__(devices, output_index)
        # One long-lived thread per lane: lane i always runs in the same thread, and starting
        # threads every step would cost more than a small model's forward.
        self._pools: list[ThreadPoolExecutor | None] = [None] * self.n
        self._busy = BusyClock(self.n)  # running work counts at once: a long step is not 0 % busy
        self.backward_shares = BackwardShares(self._busy)  # each lane's part of one backward over all

    def scatter(self, obj: Any, sizes: Sequence[int], lanes: Sequence[int]) -> list[Any]:
        if len(lanes) == 1:
            return [obj]
        return scatter_tree(obj, len(lanes), lambda t: torch.split(t, list(sizes), dim=0))

    def replicate(self, model: nn.Module, lanes: Sequence[int], detach: bool, share: bool = False) -> ReplicaSet:
        cpu = torch.device("cpu")
        # Every lane updates copies of the buffers; the step merges them into the model (buffers.py).
        return replicate_module(model, [cpu] * len(lanes), detach, None, share)

    def parallel_apply(
        self,
        fns: Sequence[Callable[..., Any]],
        inputs: Sequence[Any],
        kwargs: Sequence[dict[str, Any]] | None,
        lanes: Sequence[int],
    ) -> list[Any]:
        kwargs = kwargs or [{}] * len(fns)
        grad_enabled = torch.is_grad_enabled()
        results: list[Any] = [None] * len(fns)

        def work(i: int) -> None:
            lane = lanes[i]
            torch.set_grad_enabled(grad_enabled)  # grad mode is thread-local
            with self.busy([lane]):
                try:
                    args = inputs[i] if isinstance(inputs[i], (list, tuple)) else (inputs[i],)
                    results[i] = fns[i](*args, **kwargs[i])
                except Exception:
                    results[i] = ExceptionWrapper(where=f"in replica {i} on device {self.lane_names[lane]}")

        if len(fns) == 1:
            work(0)
        else:
            futures = [self._pool(lane).submit(work, i) for i, lane in enumerate(lanes)]
            for f in futures:
                f.result()
        for r in results:
            if isinstance(r, ExceptionWrapper):
                r.reraise()
        return results

    def gather(self, outputs: Sequence[Any]) -> Any:
        if len(outputs) == 1:
            return outputs[0]
        return gather_tree(outputs, lambda ts: torch.cat(list(ts), dim=0))

    def make_timer(self) -> PhaseTimer:
        return PhaseTimer()

    def busy(self, lanes: Sequence[int]) -> AbstractContextManager[None]:
        return self._busy.lanes(lanes)

    def busy_backward(
        self, loss: torch.Tensor | None, lane_losses: Sequence[torch.Tensor], lanes: Sequence[int]
    ) -> AbstractContextManager[None]:
        """Each lane's own nodes of the one backward, timed as they run (``busy.lane_backward``) on the
        first three backwards and one in ten after them, the others split at the median shares measured
        (``busy.BackwardShares``); the sum of the lanes' gradients (``LaneCopies``) and the gather are no
        lane's."""
        roots = [(lane, t.grad_fn) for lane, t in zip(lanes, lane_losses, strict=True)]
        return self.backward_shares.backward(None if loss is None else loss.grad_fn, roots, is_lane_copies)

    def lane_busy_seconds(self) -> list[float]:
        return self._busy.seconds()

    def close(self) -> None:
        for p in self._pools:
            if p is not None:
                p.shutdown(wait=True)
        self._pools = [None] * self.n

    def _pool(self, lane: int) -> ThreadPoolExecutor:
        pool = self._pools[lane]
        if pool is None:
            pool = ThreadPoolExecutor(1, thread_name_prefix=f"multilane-{self.lane_names[lane]}")
            self._pools[lane] = pool
        return pool
