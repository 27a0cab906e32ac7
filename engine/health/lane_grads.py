"""Each lane's own gradient, caught where the strategy holds it before the lanes are summed.

- ``replicate``: every lane's parameters are its own tensors (``LaneCopies``' outputs), so a tensor
  hook on each receives exactly that lane's gradient before ``LaneCopies.backward`` sums them
  (``watch_replicas``: its norm at once, or with several micro-batches the sum first);
- ``persistent``: each replica's ``.grad`` holds its lane's gradient (summed over the step's
  micro-batches) until ``reduce_gradients`` sums them into the model's (``take_lanes``, called there;
  on GPUs a sampled step sums after backward, not in buckets while it runs);
- ``ddp``: a DDP communication hook sees each bucket of this rank's gradient before the all-reduce
  (``ddp_hook``);
- ``fsdp``: a custom reduce-scatter on every FSDP unit sees this rank's gradient of the unit, whole
  (every rank computes the whole unit's gradient of its own samples), just before the reduce-scatter
  (``fsdp_reduce_scatter``): no extra memory, one norm per unit on a sampled step. The engine's fsdp
  strategy and an outside loop's FSDP2 model (Lightning's ``ModelParallelStrategy``) both install it
  through ``probe_reduce_scatter``. An outside loop may reduce-scatter at every micro-batch: then the
  rank's gradient of the whole step never exists unsharded, and the noise scale is measured only with
  one micro-batch per step (engine/integrations/health.py).

Norms stay on the device; ``read()`` returns them all at log time in one transfer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from multilane.engine.tensors.grads import dense_part, grad_sum
from multilane.engine.tensors.grads import squared_norm as _squared_norm


def squared_norm(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``Σ |t|²`` over ``tensors`` as a float64 0-dim tensor on ``device`` (no sync): one
    ``_foreach_norm`` and one ``stack`` where the norms share a device and a dtype (measured every
    step, the per-tensor conversions of the general helper cost as much as the norms)."""
    parts = [dense_part(t.detach()) for t in tensors]
    if not parts or len({(t.device, t.dtype) for t in parts}) > 1:
        return _squared_norm(tensors, device)
    return torch.stack(torch._foreach_norm(parts)).to(device, torch.float64).square().sum()


def _bucket_norm(flat: torch.Tensor) -> torch.Tensor:
    """``|flat|`` without a float64 copy of the bucket (fp16/bf16: in float32, where a loss-scaled
    bucket's norm cannot overflow)."""
    x = dense_part(flat.detach())
    return torch.linalg.vector_norm(x if x.dtype in (torch.float32, torch.float64) else x.float())


class LaneGradProbe:
    """Catches ``|h_i|²`` for every lane over one optimizer step, while ``armed``."""

    def __init__(self, lanes: int, device: torch.device, always: bool = False) -> None:
        self.lanes = lanes
        self.always = always  # a ddp rank: a vector at every sampled step, for the ranks' sum
        self.device = device
        self.armed = False
        self._accum = 1
        self._grads: list[dict[int, torch.Tensor]] = [{} for _ in range(lanes)]
        self._sq: list[torch.Tensor | None] = [None] * lanes

    def arm(self, accum: int) -> None:
        self.armed = True
        self._accum = accum
        self._grads = [{} for _ in range(self.lanes)]
        self._sq = [None] * self.lanes

    def disarm(self) -> None:
        self.armed = False
        self._grads = [{} for _ in range(self.lanes)]

    # -- replicate: one hook on the node that sums the lanes' copies ---------------------------------
    def watch_replicas(self, params: Sequence[Sequence[torch.Tensor]], lanes: Sequence[int]) -> None:
        """See the gradient of every differentiable parameter copy of each lane in ``lanes``
        (``params[k]``: lane ``lanes[k]``'s copies, in ``model.parameters()`` order). The copies are
        outputs of one ``LaneCopies`` node: one pre-hook on it receives every lane's gradients at once
        (one Python call and one ``_foreach_norm`` a step; a Python hook per copy cost ~4 % of a small
        model's step on CPU lanes), and keeps no reference to them (a kept gradient makes the model's
        ``AccumulateGrad`` copy the lanes' sum instead of taking it). With several micro-batches a
        step the lanes' gradients are summed first. Copies of several nodes: a hook on each copy."""
        kept = [(lane, j, p) for lane, ps in zip(lanes, params, strict=True) for j, p in enumerate(ps)]
        kept = [(lane, j, p) for lane, j, p in kept if p.requires_grad and p.grad_fn is not None]
        nodes = {id(p.grad_fn) for _, _, p in kept}
        if len(nodes) == 1:
            where = [(lane, j, p.output_nr) for lane, j, p in kept]
            kept[0][2].grad_fn.register_prehook(self._node_hook(where))
            return
        for lane, j, p in kept:
            p.register_hook(self._hook(lane, j))

    def _node_hook(self, where: Sequence[tuple[int, int, int]]) -> Callable[[Any], None]:
        def hook(grad_outputs: Any) -> None:
            if self._accum > 1:
                for lane, j, nr in where:
                    g = grad_outputs[nr]
                    if g is not None:
                        old = self._grads[lane].get(j)
                        self._grads[lane][j] = g.detach() if old is None else grad_sum(old, g.detach())
                return
            lanes, parts = [], []
            for lane, _, nr in where:
                g = grad_outputs[nr]
                if g is not None:  # None: a parameter copy no sample of this lane reached
                    lanes.append(lane)
                    parts.append(dense_part(g.detach()))
            norms = torch._foreach_norm(parts) if parts else []
            for lane in dict.fromkeys(lanes):
                mine = [n for n, k in zip(norms, lanes, strict=True) if k == lane]
                self._add(lane, torch.stack(mine).to(self.device, torch.float64).square().sum())

        return hook

    def _hook(self, lane: int, j: int) -> Callable[[torch.Tensor], None]:
        store = self._grads[lane]

        def hook(g: torch.Tensor | None) -> None:
            if g is None:
                return
            old = store.get(j)
            # out of place: ``g`` is the very tensor LaneCopies then sums
            store[j] = g.detach() if old is None else grad_sum(old, g.detach())

        return hook

    # -- persistent: each replica's own .grad before the reduce ---------------------------------
    def take_lanes(self, params: Sequence[Sequence[torch.Tensor]]) -> None:
        """``params[lane]``: that lane's replica parameters; their ``.grad`` is the lane's gradient."""
        for lane, lane_params in enumerate(params):
            grads = [p.grad for p in lane_params if p.grad is not None]
            if grads:
                self._sq[lane] = squared_norm(grads, self.device)

    # -- ddp: this rank's buckets before the all-reduce -----------------------------------------
    def add_bucket(self, lane: int, flat: torch.Tensor, scale: float) -> None:
        # a sparse bucket (DDP gives an Embedding(sparse=True)'s gradient a bucket of its own) is uncoalesced:
        # its |·|² is that of its coalesced values
        self._add(lane, _bucket_norm(flat).to(self.device, torch.float64).square() * (scale * scale))

    def add_grads(self, lane: int, grads: Sequence[torch.Tensor], scale: float) -> None:
        """``lane``'s whole gradient at once (a ddp rank's first step, reduced by hand, not in DDP's
        buckets: ``RankRules.reduce_probe``), times ``scale`` as a bucket's."""
        self._add(lane, squared_norm(grads, self.device) * (scale * scale))

    def _add(self, lane: int, sq: torch.Tensor) -> None:
        old = self._sq[lane]
        self._sq[lane] = sq if old is None else old + sq

    # -- the step's end ---------------------------------------------------------------------------
    def lane_squares(self) -> torch.Tensor | None:
        """``|h_i|²`` per lane (float64, on the probe's device; 0 for a lane without a gradient), or None
        if no lane's gradient was caught."""
        for lane, store in enumerate(self._grads):
            if store:
                self._sq[lane] = squared_norm(list(store.values()), self.device)
        self._grads = [{} for _ in range(self.lanes)]
        sq, self._sq = self._sq, [None] * self.lanes
        if all(s is None for s in sq) and not self.always:
            return None
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        return torch.stack([zero if s is None else s for s in sq])


def ddp_comm_hook(probe: LaneGradProbe, rank: int, world: int) -> Callable[[Any, Any], Any]:
    """A DDP communication hook: this rank's bucket's ``|·|²`` into ``probe`` (while it is armed), then
    torch's own all-reduce hook (the mean over the ranks, as DDP does without a hook)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def hook(state, bucket):  # no annotations: torch checks them against its own types
        if probe.armed:
            # The rank's loss is its shard's part of the batch's times ``world`` (DDP divides by it).
            probe.add_bucket(rank, bucket.buffer(), 1.0 / world)
        return allreduce_hook(state, bucket)

    return hook


def fsdp_reduce_scatter(probe: LaneGradProbe, rank: int, world: int) -> Any:
    """An FSDP2 reduce-scatter (``FSDPModule.set_custom_reduce_scatter``) that first adds this rank's
    ``|·|²`` of the flat input into ``probe`` (while it is armed), then runs torch's own. The input is
    this rank's gradient of one unit's parameters, accumulated over the step's micro-batches, before the
    ranks' are combined: FSDP's dim-0 padding is zeros (adds nothing), and FSDP has divided it by its
    pre-divide factor in place (float64/fp16 reduce in two halves: torch's own rule gives the factor)."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        DefaultReduceScatter,
        _get_gradient_divide_factors,
    )

    class ProbeReduceScatter(DefaultReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):  # torch's signature
            if probe.armed:
                pre = _get_gradient_divide_factors(group, None, input_tensor.dtype, input_tensor.device.type)[0]
                # The rank's loss is its shard's part of the batch's times ``world`` (FSDP averages).
                probe.add_bucket(rank, input_tensor, (pre or 1.0) / world)
            return super().__call__(output_tensor, input_tensor, group, op, async_op)

    return ProbeReduceScatter()


OURS = ("DefaultReduceScatter", "ProbeReduceScatter")  # torch's own, or an earlier run's probe


def is_sharded(model: torch.nn.Module) -> bool:
    """Some parameter of ``model`` is a ``DTensor`` (FSDP2, tensor parallelism)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def probe_reduce_scatter(model: torch.nn.Module, probe: LaneGradProbe, rank: int, world: int) -> str | None:
    """Every FSDP2 module of ``model`` reduce-scatters through ``fsdp_reduce_scatter``; None, or why
    not (a model without FSDP2 modules, one whose FSDP reduce-scatters through a comm of the user's
    own, which stays theirs, a torch without the hook)."""
    from torch.distributed.fsdp import FSDPModule

    fsdp = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not fsdp:
        return "no module is FSDP2's (fully_shard)"
    for m in fsdp:
        try:
            groups = m._get_fsdp_state()._fsdp_param_groups
        except AttributeError:  # another torch's internals: nothing to tell
            break
        for g in groups:
            comm = getattr(g, "_reduce_scatter_comm", None)
            if comm is not None and type(comm).__name__ not in OURS:
                return f"the model's FSDP already reduce-scatters through its own {type(comm).__name__}"
    try:
        comm = fsdp_reduce_scatter(probe, rank, world)
        for m in fsdp:
            m.set_custom_reduce_scatter(comm)
    except (ImportError, ValueError, RuntimeError) as e:
        return str(e).splitlines()[0] if str(e) else type(e).__name__
    return None
