"""Persistent replicas: the model is copied to the devices once per run, not at every step.

``ReplicateEachStep`` (strategy.py) re-creates every module of the model on every device at every
step, then runs the whole backward through the first device's graph — what ``nn.DataParallel`` does,
with its per-step Python cost that grows with the number of modules. ``PersistentReplicas`` keeps
one replica per lane for the whole run instead:

- lane 0's replica is the model itself (the one the optimizer and the checkpoint see); every other
  lane holds a full copy on its own device, made the first time it is needed;
- forward and loss run exactly as in ``ReplicateEachStep`` (same scatter, autocast, loss weighting,
  gather), each lane on its own replica;
- ``backward`` runs each lane's backward in that lane, all at once, from the gradient the combined
  loss sends to that lane's loss (so the trainer's loss scaling and accumulation divisor apply as they
  would to one backward): each replica's own ``.grad`` then holds its shard's gradient;
- the gradients are summed into the model's: on GPUs in buckets while backward runs (buckets.py: a
  bucket is summed as soon as every lane has its gradients), and ``reduce_gradients`` sums whatever is
  left after backward (everything, on CPU lanes) (coalesced.py: ``_foreach`` kernels on one device, torch.cuda.comm's coalesced
  collectives across GPUs);
- the optimizer steps the model alone; ``sync_replicas`` then copies its weights and buffers into the
  other replicas in place, so every replica is bitwise identical to the model after every step.

Randomness and buffers follow ``ReplicateEachStep``'s rules: each lane draws from its own random
stream (lane_rng.py, through the same ``_apply``), and after the forward the model's buffers are the
active replicas' merged (buffers.py); the other replicas' are overwritten from the model's before
they run again. A change to the model's weights
or buffers made outside a step (``load_state_dict``, a hand edit, a forward without a step) is noticed
through their version counters and copied to the replicas before the next forward. A forward that
changes parameters in place is merged across the replicas by the lanes' in-place rule (inplace_watch.py).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from multilane.engine.parallel.backend import Backend
from multilane.engine.parallel.buckets import GradBuckets
from multilane.engine.parallel.coalesced import copy_into, sum_into
from multilane.engine.parallel.lane_loss import model_args
from multilane.engine.parallel.replicas.buffers import merge_buffers
from multilane.engine.parallel.replicas.inplace_watch import InplaceWatch
from multilane.engine.parallel.replicas.lane_rng import LaneRandomnessError
from multilane.engine.parallel.replicas.sync_batchnorm import LaneBatchNorm
from multilane.engine.parallel.strategy import ReplicateEachStep, StepOutput
from multilane.engine.parallel.timing import PhaseTimer
from multilane.engine.tensors.grads import add_grad, is_sparse
from torch import nn


class ReplicaCopyError(RuntimeError):
    """The model cannot be copied to the other lanes (copy.deepcopy failed)."""


class PersistentReplicas(ReplicateEachStep):
    """One replica per lane kept for the whole run; gradients summed across lanes as backward makes them."""

    def __init__(self, backend: Backend, precision: str = "fp32", seed: int = 0, overlap: bool | None = None) -> None:
        super().__init__(backend, precision, seed)
        self.overlap = backend.device_type == "cuda" if overlap is None else overlap
        """Sum gradient buckets while backward runs (buckets.py), or all after backward. By default on
        GPUs only: on CPU lanes the per-parameter Python hooks cost more than the overlap saves
        (docs/performance.md)."""
        self._buckets: GradBuckets | None = None
        self._model: nn.Module | None = None
        self._replicas_by_lane: list[nn.Module] = []
        self._params: list[list[nn.Parameter]] = []  # per lane, in model.parameters() order
        self._buffers: list[list[torch.Tensor]] = []
        self._module_pairs: list[tuple[nn.Module, list[nn.Module]]] = []
        self._training: bool | None = None
        self._versions: list[int] = []  # the model's parameters and buffers, at the last copy
        self._watch: InplaceWatch | None = None
        self._buffers_stale = False  # the other replicas' buffers differ from the model's merged ones
        self._joined = False  # the lanes' graphs are joined (synchronized BatchNorm)

    # -- replicas -------------------------------------------------------------------------------
    def _forward_lanes(
        self, model: nn.Module, shard_inputs: list[Any], lanes: list[int], active: list[int], timer: PhaseTimer
    ) -> list:
        """The forward of every lane on its own persistent replica and its own random stream, then the
        model's buffers become the active replicas' merged, as with ReplicateEachStep (buffers.py).

        A forward runs again in two cases, each time from the buffers as they were (BatchNorm's running
        statistics must take one update): its lanes drew random numbers while they ran unlocked
        (lane_rng.py), or a lane computed with parameter values other lanes changed in place
        (inplace_watch.py)."""
        timer.mark("replicate")
        replicas = self._replicas(model, lanes)
        watch = self._watch
        assert watch is not None
        kind = "train" if model.training else "eval"
        args_kwargs = [model_args(x) for x in shard_inputs]
        args, kwargs = [a for a, _ in args_kwargs], [k for _, k in args_kwargs]
        may_rerun = watch.may_rerun or not self.random.locked(kind)
        saved = [b.detach().clone() for b in self._buffers[0]] if may_rerun else None
        watch.before(lanes)
        timer.mark("forward")
        try:
            outputs = self._apply(kind, self._wrap(replicas), args, kwargs, lanes)
        except LaneRandomnessError:
            self._restore_buffers(saved)
            watch.before(lanes)
            outputs = self._apply(kind, self._wrap(replicas), args, kwargs, lanes)
        if watch.after(lanes):
            del outputs
            self._restore_buffers(saved)
            watch.before(lanes)
            outputs = self._apply(kind, self._wrap(replicas), args, kwargs, lanes)
            watch.settled(lanes)
        if self._buffers[0]:
            merge_buffers(model, replicas, active)
            self._buffers[0] = list(model.buffers())  # merge_buffers gives the model new tensors
            self._buffers_stale = len(self._buffers) > 1
            self._record_versions()
        return outputs

    def _restore_buffers(self, saved: list[torch.Tensor] | None) -> None:
        assert saved is not None
        with torch.no_grad():
            copy_into(self._buffers, saved)

    def _replicas(self, model: nn.Module, lanes: list[int]) -> list[nn.Module]:
        if model is not self._model:
            self._build(model)
        elif self._master_versions() != self._versions:
            self._copy_weights()
        elif self._buffers_stale:
            with torch.no_grad():
                copy_into(self._buffers[1:], self._buffers[0])
            self._buffers_stale = False
        if model.training != self._training:
            for m, copies in self._module_pairs:
                for r in copies:
                    r.training = m.training
            self._training = model.training
        return [self._replicas_by_lane[lane] for lane in lanes]

    def _build(self, model: nn.Module) -> None:
        replicas = [model]
        made = [name for name, b in model.named_buffers() if b.grad_fn is not None]
        if made and len(self.backend.devices) > 1:  # what copy.deepcopy refuses, named in the model's words
            raise ReplicaCopyError(
                f"persistent replicas: buffer {made[0]!r} requires grad and is the output of a computation "
                f"(not a leaf), which cannot be copied to the other devices; "
                f'use devices.strategy = "replicate", or register the buffer detached'
            )
        for device in self.backend.devices[1:]:
            try:
                r = copy.deepcopy(model)
            except Exception as e:
                raise ReplicaCopyError(
                    f"persistent replicas: the model cannot be copied to the other devices "
                    f'(copy.deepcopy: {type(e).__name__}: {e}); use devices.strategy = "replicate"'
                ) from e
            r = r.to(device.torch_device())
            for p in r.parameters():
                p.grad = None
            replicas.append(r)
        self.close()
        self._model = model
        self._replicas_by_lane = replicas
        self._params = [list(r.parameters()) for r in replicas]
        self._buffers = [list(r.buffers()) for r in replicas]
        if any(len(p) != len(self._params[0]) for p in self._params):
            raise ReplicaCopyError("persistent replicas: a copy of the model has a different set of parameters")
        modules = [list(r.modules()) for r in replicas]
        self._module_pairs = [(m, list(rest)) for m, *rest in zip(*modules, strict=True)]
        self._training = model.training
        self._joined = any(isinstance(m, LaneBatchNorm) for m in model.modules())
        self._record_versions()
        params0 = self._params[0]
        names = {id(p): n for n, p in model.named_parameters()}
        self._watch = InplaceWatch(self._params, lambda j: names.get(id(params0[j]), "?"), self.backend.lane_names)
        if self.overlap and len(replicas) > 1:
            self._buckets = GradBuckets(self._params)

    def _copy_weights(self) -> None:
        """Copy the model's parameters and buffers into every other replica (in place)."""
        if len(self._params) > 1:
            with torch.no_grad():
                copy_into(self._params[1:], self._params[0])
                copy_into(self._buffers[1:], self._buffers[0])
        self._buffers_stale = False
        self._record_versions()

    def _record_versions(self) -> None:
        self._versions = self._master_versions()

    def _master_versions(self) -> list[int]:
        """The version counters of the model's parameters and buffers: any in-place change bumps one."""
        return [t._version for t in (*self._params[0], *self._buffers[0])]

    # -- the step -------------------------------------------------------------------------------
    def backward(self, out: StepOutput, loss: torch.Tensor) -> None:
        """Each lane's backward in its own lane, seeded with what ``loss`` sends to that lane's loss."""
        if not out.shard_losses:
            with self.backend.busy(out.lanes):
                loss.backward()  # one lane: lane 0's replica is the model
            return
        seeds = torch.autograd.grad(loss, out.shard_losses)
        # A step whose lanes' own gradients are sampled (engine/health) sums them after backward.
        buckets = self._buckets if not (self.lane_grads is not None and self.lane_grads.armed) else None
        if buckets is not None:
            buckets.arm(out.lanes)
        try:
            if self._joined or self.random.locked("train"):
                # One backward over every lane's graph: the lanes' graphs are joined (synchronized
                # BatchNorm's statistics cross them), or the forward draws random numbers and a
                # recomputing backward (torch.utils.checkpoint) sets the shared default generator to
                # the state it saved, which lanes must not do at once. On GPUs the autograd engine
                # still runs each device's part in that device's own thread; on CPU lanes each lane is
                # credited with its own nodes' time (Backend.busy_backward).
                with self.backend.busy_backward(None, out.shard_losses, out.lanes):
                    torch.autograd.backward(out.shard_losses, seeds)
            else:
                self.backend.parallel_apply(
                    [torch.autograd.backward] * len(out.lanes),
                    list(zip(out.shard_losses, seeds, strict=True)),
                    None,
                    out.lanes,
                )
        finally:
            if buckets is not None:
                buckets.disarm()

    def reduce_gradients(self, timer: PhaseTimer) -> None:
        """Sum what backward's buckets left (all of it without overlap) into the model's gradients, and
        clear the other replicas' gradients."""
        if len(self._params) < 2:
            return
        timer.mark("reduce")
        self._sum_buffer_grads()
        if self.lane_grads is not None and self.lane_grads.armed:
            self.lane_grads.take_lanes(self._params)  # each lane's own gradient, before the sum
        master, others = self._params[0], self._params[1:]
        left = [j for j, p in enumerate(master) if p.requires_grad and any(lane[j].grad is not None for lane in others)]
        if not left:
            return
        with torch.no_grad():
            if all(_dense(master[j].grad) and all(_dense(lane[j].grad) for lane in others) for j in left):
                # The usual case: every lane holds a dense gradient for every parameter left.
                sum_into([master[j].grad for j in left], [[lane[j].grad for j in left] for lane in others])
            else:
                _sum_each([master[j] for j in left], [[lane[j] for j in left] for lane in others])
        for lane in others:
            for j in left:
                lane[j].grad = None

    def _sum_buffer_grads(self) -> None:
        """A buffer that requires grad gets every lane's gradient in the model's own ``.grad`` (lane
        order), as one backward through ``replicate``'s copies gives it."""
        master, others = self._buffers[0], self._buffers[1:]
        for j, b in enumerate(master):
            if not b.requires_grad:
                continue
            total = b.grad
            for lane in others:
                g = lane[j].grad
                if g is not None:
                    total = g.to(b.device) if total is None else total + g.to(b.device)
                    lane[j].grad = None
            b.grad = total

    def sync_replicas(self, model: nn.Module, timer: PhaseTimer) -> None:
        """After the optimizer step: copy the model's new weights (and buffers) into the other replicas."""
        if model is not self._model or len(self._params) < 2:
            return
        timer.mark("replicate")
        self._copy_weights()

    def replicas(self) -> list[nn.Module]:
        """The replica each lane runs (lane 0's is the model); empty before the first step."""
        return list(self._replicas_by_lane)

    def close(self) -> None:
        if self._buckets is not None:
            self._buckets.remove()  # the model's own parameters carry hooks too
            self._buckets = None
        self._model = None
        self._replicas_by_lane, self._params, self._buffers, self._module_pairs = [], [], [], []


def _dense(g: torch.Tensor | None) -> bool:
    return g is not None and not is_sparse(g)


def _sum_each(master: Sequence[nn.Parameter], others: Sequence[Sequence[nn.Parameter]]) -> None:
    """The reduce, one parameter at a time, when some lane has no gradient for some parameter (a lane
    that sat the step out, a parameter a shard did not reach) or a gradient is sparse
    (``Embedding(sparse=True)``: summed as sparse tensors, as one device's backward accumulates them;
    a sparse and a dense one give a dense one): sum what exists, in lane order; None where no lane
    has one."""
    for j, p in enumerate(master):
        for lane in others:
            g = lane[j].grad
            if g is not None:
                add_grad(p, g)
