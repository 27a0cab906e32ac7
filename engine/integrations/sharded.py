"""Per-layer health of a model whose parameters are sharded over the ranks (FSDP2's ``fully_shard``,
as Lightning's ``ModelParallelStrategy`` applies it in ``configure_model``).

Each parameter is a ``DTensor``: every rank holds its shard (``to_local()``: the rank's own rows,
FSDP2's padding excluded) and its gradient's shard, already averaged over the ranks by FSDP's
reduce-scatter. A layer's ``|g|²``, ``|w|²`` and ``|Δw|²`` are the sums of its parameters' local
squares over the ranks: each rank computes its own (as the engine's ``LayerSample`` does, on its
shards) and one all-reduce per sampled step sums them, so the values are the whole layer's exactly.
A parameter replicated over a mesh dimension (``Replicate``, or a plain tensor FSDP did not shard)
is held whole by several ranks: its squares count once (divided by its number of copies). The
activations' sums (sum, sum of squares, zeros, count) are summed in the same all-reduce: the
activation statistics of the whole step's batch, every rank's micro-batches.

The noise scale needs each rank's own gradient before FSDP combines them: FSDP2's reduce-scatter
(``FSDPModule.set_custom_reduce_scatter``, one call per module's parameter group in each backward)
is handed this rank's whole, padded gradient of the group (padding zeros add nothing). A step of one
micro-batch per rank is one backward: the squares of those inputs over every group are the rank's
``|h_r|²``. With accumulation FSDP reduce-scatters at every micro-batch (Lightning keeps ``no_sync``
for DDP), so the rank's gradient of the step never exists whole: no noise scale then.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from multilane.engine.health.lane_grads import LaneGradProbe
from multilane.engine.health.layers import LayerSample
from multilane.engine.health.monitor import HealthMonitor
from torch import nn
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter


def is_sharded(model: nn.Module) -> bool:
    """Some parameter of ``model`` is a ``DTensor`` (FSDP2, tensor parallelism)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _copies(p: torch.Tensor, world: int) -> int:
    """How many ranks hold the same values of ``p``'s local tensor."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(p, DTensor):
        return world  # not sharded: every rank holds it whole
    n = 1
    for dim, placement in enumerate(p.placements):
        if isinstance(placement, Replicate):
            n *= p.device_mesh.size(dim)
    return n


class ShardedLayerSample(LayerSample):
    """``LayerSample`` on each rank's shards, its sums completed over the ranks in ``tensors``."""

    def __init__(self, model: nn.Module, kinds: Sequence[str], device: torch.device, world: int) -> None:
        super().__init__(model, kinds, device)
        self.world = world
        weights = [1.0 / _copies(p, world) for p in self.params]
        self.weight = torch.tensor(weights, dtype=torch.float64, device=device)

    def _sq(self, tensors: list[torch.Tensor], which: list[int]) -> torch.Tensor:
        """Per layer ``Σ weight·|local|²`` over the parameters ``which`` (their local tensors ``tensors``)."""
        n = len(self.names)
        out = torch.zeros(n, dtype=torch.float64, device=self.device)
        if not tensors:
            return out
        norms = torch._foreach_norm([t.detach() for t in tensors])
        idx = torch.tensor(which, dtype=torch.long, device=self.device)
        sq = torch.stack([x.to(self.device, torch.float64) for x in norms]).square() * self.weight[idx]
        return out.index_add_(0, self.owner[idx], sq)

    def gradients(self, scale: torch.Tensor | None) -> None:
        grads = [(k, _local(p.grad)) for k, p in enumerate(self.params) if p.grad is not None]
        sq = self._sq([g for _, g in grads], [k for k, _ in grads])
        self.grad_sq = sq if scale is None else sq / scale.to(sq).square()

    def before_update(self) -> None:
        self._before = torch._foreach_mul([_local(p).detach() for p in self.params], 1.0)

    def after_update(self) -> None:
        if not self.params:
            return
        now = [_local(p).detach() for p in self.params]
        every = list(range(len(now)))
        self.weight_sq = self._sq(now, every)
        if self._before is not None:
            torch._foreach_sub_(self._before, now)
            self.update_sq = self._sq(self._before, every)
            self._before = None

    def tensors(self) -> dict[str, torch.Tensor]:
        """The step's sums over every rank (one all-reduce; every rank calls it on a sampled step)."""
        import torch.distributed as dist

        mine = super().tensors()
        n, acts = len(self.names), len(self.act_names)
        layout = [("grad_sq", n), ("weight_sq", n), ("update_sq", n), ("act", 4 * acts)]
        parts, present = [], []
        for key, size in layout:
            t = mine.get(key)
            present.append(1.0 if t is not None else 0.0)
            parts.append(t.reshape(-1) if t is not None else torch.zeros(size, dtype=torch.float64, device=self.device))
        pack = torch.cat([*parts, torch.tensor(present, dtype=torch.float64, device=self.device)])
        dist.all_reduce(pack)
        out: dict[str, torch.Tensor] = {}
        at = 0
        for (key, size), seen in zip(layout, pack[-len(layout) :].tolist(), strict=True):
            if seen == self.world and size:  # every rank had it (a value some rank lacks is not the layer's)
                out[key] = pack[at : at + size].reshape(acts, 4) if key == "act" else pack[at : at + size]
            at += size
        return out


class ShardedMonitor(HealthMonitor):
    """The engine's monitor on a sharded model: the step's ``|h|²`` for the noise scale is the sum of
    the layers' gradient squares, already summed over the ranks (``ShardedLayerSample.tensors``)."""

    _EMPTY = nn.Module()

    def after_reduce(self, model: nn.Module, scale: Any, lane_scale: Any = None) -> None:
        # an empty model: the monitor's own total would read the DTensor gradients as whole tensors
        super().after_reduce(self._EMPTY, scale, lane_scale)

    def after_update(self) -> None:
        sampled = self.on
        super().after_update()
        if sampled and self._pending:
            tensors = self._pending[-1][1]
            if "lane_sq" in tensors and "grad_sq" in tensors:
                tensors["total_sq"] = tensors["grad_sq"].sum().reshape(1)
            else:
                tensors.pop("lane_sq", None)
                tensors.pop("total_sq", None)


class ProbingReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter, ``|input|²`` into ``probe`` first while it is armed: this rank's part
    of the averaged gradient is its gradient over the world size (FSDP's ``AVG``; another reduction,
    as fp16's pre-divided ``SUM``, leaves the step unmeasured: NaN)."""

    def __init__(self, probe: LaneGradProbe, rank: int, world: int) -> None:
        self.probe, self.rank, self.world = probe, rank, world

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(tuple(size), dtype=dtype, device=device)

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any, async_op: bool = False
    ) -> Any:
        import torch.distributed as dist

        if self.probe.armed:
            scale = 1.0 / self.world if op == dist.ReduceOp.AVG else math.nan
            self.probe.add_bucket(self.rank, input_tensor, scale)
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def probe_reduce_scatter(model: nn.Module, probe: LaneGradProbe, rank: int, world: int) -> str | None:
    """Every FSDP2 module of ``model`` reduce-scatters through ``ProbingReduceScatter``; None, or why not."""
    from torch.distributed.fsdp import FSDPModule

    fsdp = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not fsdp:
        return "no module is FSDP2's (fully_shard)"
    for m in fsdp:  # a reduce-scatter of the user's own stays theirs
        try:
            groups = m._get_fsdp_state()._fsdp_param_groups
        except AttributeError:  # another torch's internals: nothing to tell
            break
        for g in groups:
            comm = getattr(g, "_reduce_scatter_comm", None)
            if comm is not None and type(comm).__name__ != "DefaultReduceScatter":
                return f"the model's FSDP already reduce-scatters through its own {type(comm).__name__}"
    comm = ProbingReduceScatter(probe, rank, world)
    try:
        for m in fsdp:
            m.set_custom_reduce_scatter(comm)
    except (ValueError, RuntimeError, AttributeError) as e:
        return str(e).splitlines()[0] if str(e) else type(e).__name__
    return None
