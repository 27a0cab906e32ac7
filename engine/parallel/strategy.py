"""One data-parallel step, built from a backend's four primitives.

``ReplicateEachStep`` is what ``nn.DataParallel.forward`` does, plus a loss per device:
scatter the batch → replicate the model → parallel_apply the forward → parallel_apply the loss on each
device → gather the per-device losses → combine them weighted by shard size (equal to the full-batch
mean loss). ``backward`` is one ``backward()`` on the combined loss; gradients flow back through the
replicas into the original parameters.

A strategy is four calls per optimizer step, made by the trainer in this order:
``forward_loss`` (per micro-batch) → ``backward`` (per micro-batch) → ``reduce_gradients`` (once:
the model's ``.grad`` must then hold the whole batch's gradient) → the optimizer steps the model →
``sync_replicas`` (once: whatever the strategy keeps on the other devices catches up). ``forward``
serves evaluation. ``PersistentReplicas`` (persistent.py) is the second strategy behind them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from multilane.engine.parallel.backend import Backend
from multilane.engine.parallel.timing import PhaseTimer
from multilane.engine.parallel.tree import first_tensor
from torch import nn
from torch._utils import ExceptionWrapper

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class StepOutput:
    loss: torch.Tensor
    """The combined loss (full-batch mean), a 0-dim tensor on the output device, with grad."""
    lane_losses: torch.Tensor
    """Each active lane's own shard loss, detached, a vector on the output device."""
    lanes: list[int]
    """Which lanes took part (a lane whose chunk is empty sits the step out)."""
    shard_losses: list[torch.Tensor] = field(default_factory=list)
    """Each active lane's loss as its lane computed it, before gather, with grad: the roots of the
    lanes' own graphs (empty on one lane, where ``loss`` is that root)."""


class LossNotScalarError(ValueError):
    """The task's loss returned something other than one number."""


def model_args(inputs: Any) -> tuple[tuple, dict]:
    """How a batch's inputs are passed to the model: a tensor as one argument, a tuple as positional
    arguments, a dict as keyword arguments."""
    if isinstance(inputs, dict):
        return (), inputs
    if isinstance(inputs, tuple):
        return inputs, {}
    return (inputs,), {}


class _InReplica:
    """Runs ``fn`` inside autocast with the run's dtype, entered in the replica's own thread.

    torch's parallel_apply forwards only autocast's enabled flag to its threads, not the dtype.
    """

    def __init__(self, fn: Callable[..., Any], device_type: str, dtype: torch.dtype) -> None:
        self.fn, self.device_type, self.dtype = fn, device_type, dtype

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.fn(*args, **kwargs)


class OutputShapeError(ValueError):
    """The model's output does not hold one row per input sample."""


def check_batch(output: Any, target: Any) -> None:
    """The model must return one row per sample: a wrong batch size would broadcast silently."""
    out, tgt = first_tensor(output), first_tensor(target)
    if out is not None and tgt is not None and out.dim() > 0 and tgt.dim() > 0 and out.shape[0] != tgt.shape[0]:
        raise OutputShapeError(
            f"the model returned {out.shape[0]} rows (shape {tuple(out.shape)}) for {tgt.shape[0]} samples"
        )


class _LaneLoss:
    """A lane's loss as a 1-element vector (fp32 at least), so that gather stacks them without a warning."""

    def __init__(self, loss_fn: Callable[[Any, Any], torch.Tensor]) -> None:
        self.loss_fn = loss_fn

    def __call__(self, output: Any, target: Any) -> torch.Tensor:
        check_batch(output, target)
        return self.check(self.loss_fn(output, target)).reshape(1)

    @staticmethod
    def check(loss: Any) -> torch.Tensor:
        """The loss as a 0-dim tensor, in fp32 at least; LossNotScalarError if it is not one number."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise LossNotScalarError(f"the loss must be one number (a 0-dim tensor), got {shape}")
        if loss.dtype in (torch.float16, torch.bfloat16):
            loss = loss.float()
        return loss if loss.dim() == 0 else loss.reshape(())


class ReplicateEachStep:
    """Replicate the model at every step, as ``nn.DataParallel`` does."""

    def __init__(self, backend: Backend, precision: str = "fp32") -> None:
        self.backend = backend
        self.autocast_dtype = AUTOCAST_DTYPES.get(precision)
        self._weights: dict[tuple, torch.Tensor] = {}

    def _wrap(self, fns: Sequence[Callable[..., Any]]) -> Sequence[Callable[..., Any]]:
        if self.autocast_dtype is None:
            return fns
        return [_InReplica(f, self.backend.device_type, self.autocast_dtype) for f in fns]

    def _active(self, sizes: Sequence[int]) -> tuple[list[int], list[int]]:
        lanes = [i for i, s in enumerate(sizes) if s > 0]
        return lanes, [sizes[i] for i in lanes]

    def _weight(self, sizes: list[int], dtype: torch.dtype) -> torch.Tensor:
        key = (*sizes, dtype)
        w = self._weights.get(key)
        if w is None:
            total = sum(sizes)
            w = torch.tensor([s / total for s in sizes], dtype=dtype, device=self.backend.output_device)
            self._weights[key] = w
        return w

    def forward_loss(
        self,
        model: nn.Module,
        inputs: Any,
        target: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        sizes: Sequence[int],
        timer: PhaseTimer,
    ) -> StepOutput:
        """Forward and loss of one (micro-)batch on every lane; the caller runs backward."""
        b = self.backend
        lanes, active = self._active(sizes)
        if lanes == [0]:
            return self._single_lane(model, inputs, target, loss_fn, timer)
        timer.mark("scatter")
        shard_inputs = b.scatter(inputs, active, lanes)
        shard_targets = b.scatter(target, active, lanes)
        timer.mark("replicate")
        replicas = self._replicas(model, lanes)
        timer.mark("forward")
        args_kwargs = [model_args(x) for x in shard_inputs]
        outputs = b.parallel_apply(
            self._wrap(replicas), [a for a, _ in args_kwargs], [k for _, k in args_kwargs], lanes
        )
        timer.mark("loss")
        lane_loss = _LaneLoss(loss_fn)
        losses = b.parallel_apply(
            self._wrap([lane_loss] * len(lanes)),
            list(zip(outputs, shard_targets, strict=True)),
            None,
            lanes,
        )
        lane_losses = b.gather(losses)
        combined = lane_losses[0] if len(lanes) == 1 else (lane_losses * self._weight(active, lane_losses.dtype)).sum()
        return StepOutput(
            loss=combined.reshape(()), lane_losses=lane_losses.detach(), lanes=lanes, shard_losses=list(losses)
        )

    def _replicas(self, model: nn.Module, lanes: list[int]) -> list[nn.Module]:
        """The module each lane in ``lanes`` runs: fresh replicas, made every step."""
        return self.backend.replicate(model, lanes, detach=not torch.is_grad_enabled())

    def backward(self, out: StepOutput, loss: torch.Tensor) -> None:
        """Backward of ``loss`` (``out.loss``, scaled by the caller): one backward through the replicas'
        graphs, which sums every lane's gradient into the model's own parameters."""
        loss.backward()

    def reduce_gradients(self, timer: PhaseTimer) -> None:
        """Make the model's ``.grad`` the whole batch's gradient: here backward has done it."""

    def sync_replicas(self, model: nn.Module, timer: PhaseTimer) -> None:
        """Bring replicas up to date after the optimizer step: here the next step makes new ones."""

    def close(self) -> None:
        """Drop whatever the strategy holds between steps."""

    def _single_lane(self, model, inputs, target, loss_fn, timer) -> StepOutput:
        """One lane: nothing to scatter, replicate or gather (as DataParallel does with one device)."""
        fn = self._wrap([model])[0]
        args, kwargs = model_args(inputs)
        timer.mark("forward")
        try:
            output = fn(*args, **kwargs)
            timer.mark("loss")
            check_batch(output, target)
            loss = _LaneLoss(loss_fn).check(loss_fn(output, target))
        except Exception:
            ExceptionWrapper(where=f"in replica 0 on device {self.backend.lane_names[0]}").reraise()
        return StepOutput(loss=loss, lane_losses=loss.detach().reshape(1), lanes=[0])

    def forward(self, model: nn.Module, inputs: Any, sizes: Sequence[int]) -> Any:
        """The model's output for a whole batch, computed on every lane and gathered (evaluation)."""
        b = self.backend
        lanes, active = self._active(sizes)
        shard_inputs = b.scatter(inputs, active, lanes)
        replicas = self._replicas(model, lanes)
        args_kwargs = [model_args(x) for x in shard_inputs]
        outputs = b.parallel_apply(
            self._wrap(replicas), [a for a, _ in args_kwargs], [k for _, k in args_kwargs], lanes
        )
        return b.gather(outputs)
