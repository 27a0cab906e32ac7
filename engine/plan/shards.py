"""How many bytes of parameters, gradients and optimizer state one fsdp rank holds: FSDP2's sharding rule.

torch's ``FSDPParam._init_sharded_param`` (torch/distributed/fsdp/_fully_shard/_fsdp_param.py) splits
each parameter along dim 0 with ``torch.chunk`` into N pieces of ``c = ceil(dim0 / N)`` rows (the last
ones shorter, or empty), and keeps every rank's piece in a buffer padded to ``c`` rows: a rank's
parameter storage is ``c × (the other dims)`` elements whatever its piece. The gradient lands in a slice
of the reduce-scatter's output, padded the same way (``foreach_reduce``). The optimizer's state is made
by the optimizer from the rank's piece itself (``zeros_like`` of the DTensor's local tensor): rank r
holds ``min(c, max(0, dim0 - r·c))`` rows of each state tensor, and one step counter per parameter
(Adam/AdamW: a 0-dim float32 tensor). Rank 0 holds the most.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

STATES = {"adam": 2, "adamw": 2}
"""Tensors the size of a parameter each optimizer keeps (SGD: one with momentum, else none)."""


@dataclass(frozen=True)
class ShardBytes:
    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def rows(dim0: int, n: int, rank: int) -> tuple[int, int]:
    """(padded rows, own rows) of ``rank``'s piece of a dim-0 of ``dim0`` split over ``n`` ranks."""
    c = -(-dim0 // n)
    return c, min(c, max(0, dim0 - rank * c))


def shard_bytes(
    params: Iterable[torch.Tensor], n: int, rank: int = 0, optimizer: str = "adamw", momentum: float = 0.0
) -> ShardBytes:
    """The bytes ``rank`` of ``n`` holds for ``params`` (whole tensors, before sharding) with that optimizer."""
    states = STATES.get(optimizer, 1 if momentum else 0)
    step = 4 if optimizer in STATES else 0  # Adam's per-parameter step: a float32 scalar tensor
    p = g = o = 0
    for t in params:
        shape = tuple(t.shape) or (1,)
        rest = t.numel() // shape[0] if shape[0] else 0
        padded, own = rows(shape[0], n, rank)
        size = t.element_size()
        p += padded * rest * size
        if t.requires_grad:
            g += padded * rest * size
            o += states * own * rest * size + step
    return ShardBytes(p, g, o)
