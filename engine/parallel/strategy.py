"""One data-parallel step, built from a backend's four primitives.

``ReplicateEachStep`` is what ``nn.DataParallel.forward`` does, plus a loss per device:
scatter the batch → replicate the model (true replicas on every lane) → parallel_apply the forward →
parallel_apply the loss (and the task's loss weight) on each device → gather the per-device losses →
combine them weighted by what each device's mean is over: its shard size, or the task's
``loss_weight`` (tokens, class weights) — equal to the full-batch loss. The trainer then calls
``backward()`` once on the combined loss (``backward``); gradients flow back through the replicas
into the original parameters.

A strategy is three calls per optimizer step, made by the trainer in this order: ``train_micro``
(per micro-batch: ``forward_loss``, then ``backward`` of its scaled loss) → ``reduce_gradients`` (once:
the model's ``.grad`` must then hold the whole batch's gradient) → the optimizer steps the model →
``sync_replicas`` (once: whatever the strategy keeps on the other devices catches up). ``forward_loss``
alone and ``forward`` serve evaluation. ``PersistentReplicas`` (persistent.py) is the second strategy
behind them.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from multilane.engine.parallel.backend import Backend
from multilane.engine.parallel.lane_loss import LaneLoss, LossFn, LossWeightError, WeightFn, check_batch, model_args
from multilane.engine.parallel.replicas import inplace
from multilane.engine.parallel.replicas.buffers import merge_buffers
from multilane.engine.parallel.replicas.lane_context import lane_apply
from multilane.engine.parallel.replicas.lane_rng import LaneRandom, LaneRandomnessError
from multilane.engine.parallel.timing import NoTimer, PhaseTimer
from torch import nn
from torch._utils import ExceptionWrapper

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(slots=True)
class StepOutput:
    loss: torch.Tensor
    """The combined loss (full-batch mean), a 0-dim tensor on the output device, with grad."""
    lane_losses: torch.Tensor
    """Each active lane's own shard loss, detached, a vector on the output device (one lane's step: its
    loss, detached, 0-dim; ``reshape(-1)`` makes it the vector)."""
    lanes: list[int]
    """Which lanes took part (a lane whose chunk is empty, or whose loss weight is 0, sits the step out)."""
    weight: torch.Tensor | None = None
    """With a task's ``loss_weight``: the batch's total weight (0-dim, on the output device)."""
    output: Any = None
    """The model's output gathered on the output device (``keep_output=True``, for evaluation)."""
    shard_losses: Sequence[torch.Tensor] = ()
    """Each lane's loss in ``lanes`` as its lane computed it, before gather, with grad: the roots of the
    lanes' own graphs (empty on one lane, where ``loss`` is that root)."""
    lane_weights: list[float] | None = None
    """With a task's ``loss_weight``: each lane's weight in ``lanes`` (host numbers, already read)."""


class _InReplica:
    """Runs ``fn`` inside autocast with the run's dtype, entered in the replica's own thread.

    torch's parallel_apply forwards only autocast's enabled flag to its threads, not the dtype.
    """

    def __init__(self, fn: Callable[..., Any], device_type: str, dtype: torch.dtype) -> None:
        self.fn, self.device_type, self.dtype = fn, device_type, dtype

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.fn(*args, **kwargs)


_NO_AUTOCAST = contextlib.nullcontext()
_LANE_0 = (0,)


class ReplicateEachStep:
    """Replicate the model at every step, as ``nn.DataParallel`` does."""

    def __init__(self, backend: Backend, precision: str = "fp32", seed: int = 0) -> None:
        self.backend = backend
        self.autocast_dtype = AUTOCAST_DTYPES.get(precision)
        self._weights: dict[tuple, torch.Tensor] = {}
        # Per model: did its first multi-lane forward change a parameter in place? Until that is
        # known, and for a model that does, every lane gets private copies; a model that does not gets
        # views where a lane sits on the parameters' device (no copy of the data each step).
        self._writes_params: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()
        self.random = LaneRandom([d.torch_device() for d in backend.devices], seed)
        """Each lane's random stream (lane 0's is torch's default generator); saved in checkpoints."""
        self._busy_0 = backend.busy(_LANE_0)  # one lane's bracket, reused every step
        self.lane_grads: Any = None
        """A probe (engine/health/lane_grads.py) that, while ``armed``, is shown each lane's own
        gradient before the lanes' are summed; None: nobody asks."""

    def _apply(self, kind: str, fns, inputs, kwargs, lanes) -> list[Any]:
        """parallel_apply, each lane with its own random stream and a group to exchange values in."""
        b = self.backend
        return lane_apply(b.parallel_apply, self.random, kind, fns, inputs, kwargs, lanes, b.lane_names)

    def _wrap(self, fns: Sequence[Callable[..., Any]]) -> Sequence[Callable[..., Any]]:
        if self.autocast_dtype is None:
            return fns
        return [_InReplica(f, self.backend.device_type, self.autocast_dtype) for f in fns]

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return _NO_AUTOCAST  # reusable (one lane's evaluation forward; its training step enters none)
        return torch.autocast(self.backend.device_type, dtype=self.autocast_dtype)

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
        loss_fn: LossFn,
        sizes: Sequence[int],
        timer: PhaseTimer,
        weight_fn: WeightFn | None = None,
        keep_output: bool = False,
    ) -> StepOutput:
        """Forward and loss of one (micro-)batch on every lane; the caller runs backward.

        Each lane's loss is computed in its own thread inside autocast (the run's dtype), as is the one
        lane's. Lanes are combined by shard size, or with ``weight_fn`` (the task's ``loss_weight``) by
        ``Σ wᵢ·lossᵢ / Σ wᵢ``; a lane whose weight is 0 sits out (its own mean is 0/0, whose gradient is
        NaN whatever it is multiplied by), which needs the weights on the host: one small read per step.
        """
        if len(sizes) == 1:  # one lane (no probe: a noise scale needs two)
            return self._single_lane(model, inputs, target, loss_fn, timer, weight_fn, keep_output)
        b = self.backend
        lanes, active = self._active(sizes)
        if lanes == [0] and not (self.lane_grads is not None and self.lane_grads.armed):
            # (A micro-batch only lane 0 takes, on a step whose lanes' gradients are read: through
            # its replica like any lane's, so that its part of lane 0's gradient is caught.)
            return self._single_lane(model, inputs, target, loss_fn, timer, weight_fn, keep_output)
        timer.mark("scatter")
        shard_inputs = b.scatter(inputs, active, lanes)
        shard_targets = b.scatter(target, active, lanes)
        outputs = self._forward_lanes(model, shard_inputs, lanes, active, timer)
        timer.mark("loss")
        lane_loss = self._wrap([LaneLoss(loss_fn, weight_fn)] * len(lanes))
        pairs = list(zip(outputs, shard_targets, strict=True))
        try:
            losses = self._apply("loss", lane_loss, pairs, None, lanes)
        except LaneRandomnessError:  # a loss that draws random numbers: again, locked (lane_rng.py)
            losses = self._apply("loss", lane_loss, pairs, None, lanes)
        output = b.gather(outputs) if keep_output else None
        if weight_fn is None:
            lane_losses = b.gather(losses)
            combined = (
                lane_losses[0] if len(lanes) == 1 else (lane_losses * self._weight(active, lane_losses.dtype)).sum()
            )
            return StepOutput(
                combined.reshape(()), lane_losses.detach(), lanes, output=output, shard_losses=list(losses)
            )
        w = b.gather([w for _, w in losses])
        ws = w.tolist()
        bad = [x for x in ws if not 0 <= x < math.inf]
        if bad:
            raise LossWeightError(f"loss_weight must be a finite number >= 0, got {bad[0]}")
        # A lane whose weight is 0 must not even reach the graph of the combined loss: a zero gradient
        # into its 0/0 mean still makes NaN. Its loss is left out before the gather.
        keep = [k for k, x in enumerate(ws) if x > 0] or list(range(len(ws)))
        if len(keep) < len(ws):
            losses, lanes = [losses[k] for k in keep], [lanes[k] for k in keep]
            w = w[torch.tensor(keep, device=w.device)]
        shard_losses = [loss for loss, _ in losses]
        lane_losses = b.gather(shard_losses)
        total = w.sum()
        combined = (lane_losses * w).sum() / total
        return StepOutput(
            combined,
            lane_losses.detach(),
            lanes,
            weight=total,
            output=output,
            shard_losses=shard_losses,
            lane_weights=[ws[k] for k in keep],
        )

    def train_micro(
        self,
        model: nn.Module,
        inputs: Any,
        target: Any,
        loss_fn: LossFn,
        sizes: Sequence[int],
        timer: PhaseTimer,
        weight_fn: WeightFn | None = None,
        zero: torch.optim.Optimizer | None = None,
        accum: int = 1,
        scaler: torch.amp.GradScaler | None = None,
    ) -> StepOutput:
        """One micro-batch of a training step: ``forward_loss``, then ``backward`` of its loss divided by
        ``accum`` and scaled by fp16's ``scaler`` (None: not scaled). ``zero``: the optimizer, on a step's
        first micro-batch, whose gradients are freed just before this backward (the order of PyTorch's own
        examples: backward then reuses those blocks; freeing them before the forward cost ~3 % on the CPU
        in fresh pages, bench/step_overhead.py). One lane's forward, loss and backward are one busy bracket."""
        if len(sizes) > 1:
            out = self.forward_loss(model, inputs, target, loss_fn, sizes, timer, weight_fn)
            self.backward(out, _to_backward(out, timer, zero, accum, scaler))
            return out
        with self._busy_0:
            out = self._forward_0(model, inputs, target, loss_fn, timer, weight_fn, False)
            _to_backward(out, timer, zero, accum, scaler).backward()
        return out

    def backward(self, out: StepOutput, loss: torch.Tensor) -> None:
        """Backward of ``loss`` (``out.loss``, scaled by the caller): one backward through the replicas'
        graphs, which sums every lane's gradient into the model's own parameters. One lane's backward is
        that lane's work and counts as its busy time; several lanes' run in one thread through all their
        graphs together, their nodes interleaved: each lane is credited with the time its own nodes take
        (``Backend.busy_backward``), the sum of their gradients with no lane's."""
        if len(out.lanes) == 1 or not out.shard_losses:
            with self.backend.busy(out.lanes):
                loss.backward()
            return
        with self.backend.busy_backward(loss, out.shard_losses, out.lanes):
            loss.backward()

    def reduce_gradients(self, timer: PhaseTimer) -> None:
        """Make the model's ``.grad`` the whole batch's gradient: here backward has done it."""

    def sync_replicas(self, model: nn.Module, timer: PhaseTimer) -> None:
        """Bring replicas up to date after the optimizer step: here the next step makes new ones."""

    def close(self) -> None:
        """Drop whatever the strategy holds between steps."""

    def _single_lane(self, model, inputs, target, loss_fn, timer, weight_fn, keep_output) -> StepOutput:
        """One lane: nothing to scatter, replicate or gather (as DataParallel does with one device); its
        forward and loss count as its busy time, as in parallel_apply on several lanes."""
        with self._busy_0:
            return self._forward_0(model, inputs, target, loss_fn, timer, weight_fn, keep_output)

    def _forward_0(self, model, inputs, target, loss_fn, timer, weight_fn, keep_output) -> StepOutput:
        """Lane 0's forward and loss on the model itself (in fp32 without a context around them)."""
        args, kwargs = model_args(inputs)
        timer.mark("forward")
        try:
            if self.autocast_dtype is None:
                return _model_loss(model, args, kwargs, target, loss_fn, timer, weight_fn, keep_output)
            with torch.autocast(self.backend.device_type, dtype=self.autocast_dtype):
                return _model_loss(model, args, kwargs, target, loss_fn, timer, weight_fn, keep_output)
        except Exception:
            ExceptionWrapper(where=f"in replica 0 on device {self.backend.lane_names[0]}").reraise()
            raise  # (reraise always raises)

    def _forward_lanes(
        self, model: nn.Module, shard_inputs: list[Any], lanes: list[int], active: list[int], timer: PhaseTimer
    ) -> list:
        """The forward of every lane on its own true replica, each on its own random stream (lane_rng.py);
        a forward that changes parameters in place is made equal to one device's (inplace.py). Every
        replica updates copies of the buffers, so the model's stay as they were until the forward that
        counts is done; they are then the replicas' merged (buffers.py)."""
        b = self.backend
        detach = not torch.is_grad_enabled()
        args_kwargs = [model_args(x) for x in shard_inputs]
        fns_args = ([a for a, _ in args_kwargs], [k for _, k in args_kwargs])
        writes = self._writes_params.get(model)
        share = writes is False
        kind = "train" if model.training else "eval"
        timer.mark("replicate")
        replicas = b.replicate(model, lanes, detach=detach, share=share)
        before = inplace.versions(replicas.params)
        timer.mark("forward")
        streams = self.random.mark(lanes)
        try:
            outputs = self._apply(kind, self._wrap(replicas), *fns_args, lanes)
        except LaneRandomnessError:
            # The lanes ran unlocked and drew random numbers: their draws are taken back, and the
            # forward runs again, locked, each lane on its own stream, from fresh replicas.
            replicas = b.replicate(model, lanes, detach=detach, share=share)
            before = inplace.versions(replicas.params)
            outputs = self._apply(kind, self._wrap(replicas), *fns_args, lanes)
        except RuntimeError as e:
            # Shared lanes hold views that torch refuses to use once written: a late write, named.
            touched = inplace.changed(replicas.params, before)
            if share and touched and "modified inplace" in str(e):
                raise inplace.late_write_error(model, touched) from None
            raise
        touched = inplace.changed(replicas.params, before)
        if writes is None:
            self._writes_params[model] = bool(touched)
        if touched:
            names = [b.lane_names[i] for i in lanes]
            if share:
                raise inplace.late_write_error(model, touched)
            if not inplace.merge_into_original(model, replicas.params, touched, names):
                del outputs
                self.random.rewind(streams)  # the replay draws what the first forward drew
                replicas = b.replicate(model, lanes, detach=detach)
                before = inplace.versions(replicas.params)
                outputs = self._apply(kind, self._wrap(replicas), *fns_args, lanes)
                inplace.check_settled(model, replicas.params, before, names)
        probe = self.lane_grads
        if probe is not None and probe.armed and not detach:
            probe.watch_replicas(replicas.params, lanes)  # each lane's gradient, before LaneCopies sums them
        merge_buffers(model, replicas, active)
        return outputs

    def forward(self, model: nn.Module, inputs: Any, sizes: Sequence[int]) -> Any:
        """The model's output for a whole batch, computed on every lane and gathered (evaluation)."""
        b = self.backend
        lanes, active = self._active(sizes)
        if lanes == [0]:
            args, kwargs = model_args(inputs)
            with self.backend.busy(_LANE_0), self._autocast():
                return model(*args, **kwargs)
        shard_inputs = b.scatter(inputs, active, lanes)
        return b.gather(self._forward_lanes(model, shard_inputs, lanes, active, _NO_TIMER))


def _model_loss(model, args, kwargs, target, loss_fn, timer, weight_fn, keep_output) -> StepOutput:
    """One lane's forward and loss on the model itself, checked (``_forward_0``)."""
    output = model(*args, **kwargs)
    timer.mark("loss")
    check_batch(output, target)
    loss = LaneLoss.check(loss_fn(output, target))
    weight = None if weight_fn is None else LaneLoss.weight(weight_fn(output, target), loss)
    return StepOutput(loss, loss.detach(), [0], weight=weight, output=output if keep_output else None)


def _to_backward(
    out: StepOutput, timer: PhaseTimer, zero: torch.optim.Optimizer | None, accum: int, scaler: Any
) -> torch.Tensor:
    """What a micro-batch's backward starts from (``train_micro``), the last step's gradients freed first."""
    timer.mark("backward")
    if zero is not None:
        zero.zero_grad(set_to_none=True)
    loss = out.loss / accum if accum > 1 else out.loss
    return loss if scaler is None else scaler.scale(loss)


_NO_TIMER = NoTimer()
