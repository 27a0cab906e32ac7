"""``devices.sync_batchnorm`` under ddp: BatchNorm statistics over the whole batch, across ranks.

The lanes' rule (engine/parallel/replicas/sync_batchnorm.py) on every rank: each rank computes its
shard's count, mean and sum of squared deviations, the ranks exchange them (one all-gather per
BatchNorm layer and forward, on the rank's device), and every rank combines them in rank order with
the very arithmetic ``LaneBatchNorm`` uses (Chan's formula), so ddp equals the lanes, and both equal
full-batch training. The exchange is differentiable: its backward sums every rank's gradient with
respect to the gathered statistics (one all-reduce), so a rank's parameters get the gradient that
flows through the other ranks' normalisation too, as torch's own ``SyncBatchNorm`` does.

A rank whose shard is empty (``empty_shard``) hands over a count of 0 and is left out of the
combination, as an idle lane is: a Dataset task's empty rank runs its model on one stand-in sample,
whose statistics must not count. The counts are read on the host (one small read per layer and step).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from multilane.engine.parallel.replicas.sync_batchnorm import LaneBatchNorm, SyncBatchNormError, convert_sync_batchnorm
from torch import nn
from torch.autograd import Function

_empty = [False]
_gathers: list[torch.Tensor] = []  # this forward's exchanges, for ``touch_exchanges``


def touch_exchanges() -> torch.Tensor | None:
    """Zero times every statistic this rank's forward exchanged (then forgotten), for the loss.

    Every rank must run each exchange's backward (a collective), whatever its loss: a rank with no
    samples normalises nothing, and autograd would never reach its exchanges."""
    if not _gathers:
        return None
    total = sum((g.sum() for g in _gathers[1:]), _gathers[0].sum()) * 0.0
    _gathers.clear()
    return total


@contextlib.contextmanager
def empty_shard(empty: bool) -> Iterator[None]:
    """While this rank runs its model on no samples of its own (its statistics count 0)."""
    _empty[0] = empty
    try:
        yield
    finally:
        _empty[0] = False


class _Gather(Function):
    """All ranks' rows (``world × k``) from this rank's ``k`` values; backward: the rows' summed gradient."""

    @staticmethod
    def forward(ctx: Any, vec: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        world = dist.get_world_size(group)
        rows = [torch.empty_like(vec) for _ in range(world)]
        dist.all_gather(rows, vec.contiguous(), group=group)
        return torch.stack(rows)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        return total[dist.get_rank(ctx.group)], None


class _Ranks:
    """What ``LaneBatchNorm._synced_forward`` exchanges with, across ranks instead of lanes."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def exchange(self, key: Any, value: tuple[int, torch.Tensor, torch.Tensor]) -> list[tuple[int, Any, Any]]:
        count, mean, m2 = value
        if _empty[0]:
            count, mean, m2 = 0, torch.zeros_like(mean), torch.zeros_like(m2)
        elif count == 0:  # no samples: the mean of nothing is NaN, and must not reach the others
            mean, m2 = torch.zeros_like(mean), torch.zeros_like(m2)
        c = mean.shape[0]
        vec = torch.cat([mean.new_full((1,), float(count)), mean, m2])
        if torch.is_grad_enabled() and not vec.requires_grad:
            vec.requires_grad_()  # an empty rank still joins the exchange's backward
        rows = _Gather.apply(vec, self.group)
        if rows.requires_grad:
            _gathers.append(rows)
        counts = [int(x) for x in rows[:, 0].tolist()]
        return [(n, rows[r, 1 : 1 + c], rows[r, 1 + c :]) for r, n in enumerate(counts) if n > 0]


class RankBatchNorm(LaneBatchNorm):
    """A BatchNorm whose training statistics span every rank of a ddp run (see the module docstring)."""

    group: Any = None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        batch_stats = self.training or self.running_mean is None
        if not batch_stats or not dist.is_initialized() or dist.get_world_size(self.group) == 1:
            return super().forward(input)
        self._check_input_dim(input)
        if torch._C._current_graph_task_id() != -1:
            raise SyncBatchNormError(
                "devices.sync_batchnorm: a BatchNorm inside torch.utils.checkpoint cannot be recomputed "
                "with the other ranks' statistics; keep BatchNorm layers out of checkpointed regions, or "
                "turn devices.sync_batchnorm off"
            )
        return self._synced_forward(input, _Ranks(self.group))


def convert_rank_batchnorm(module: nn.Module, group: Any = None) -> nn.Module:
    """Replace every BatchNorm in ``module`` with a ``RankBatchNorm`` holding the same parameters and
    buffers; returns the module."""
    return convert_sync_batchnorm(module, RankBatchNorm, group=group)
