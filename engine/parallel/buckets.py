"""Gradient buckets that are summed across lanes while backward still runs.

Every trainable parameter of every replica gets a post-accumulate-grad hook. Parameters are grouped
into buckets in reverse order (backward makes the last layers' gradients first), the first bucket
small so that the sum starts early, the rest larger (DDP's bucketing: 1 MB, then 25 MB). When the last
active lane's hook for the last parameter of a bucket fires, that bucket's gradients are final on every
lane, and that lane's thread sums them into the model's gradients (coalesced.sum_into) while the
other lanes go on with their backward. A bucket that never fills (a parameter a lane's shard did not
reach) is left to the strategy's ``reduce_gradients`` after backward.

Bucket sums are serialized by one lock: on GPUs they are collectives (NCCL), which every device must
see in the same order.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence

import torch
from multilane.engine.parallel.coalesced import BUCKET_BYTES, sum_into
from multilane.engine.tensors.grads import add_grad, is_sparse
from torch import nn

FIRST_BUCKET_BYTES = 1024 * 1024


def bucket_indices(params: Sequence[nn.Parameter]) -> list[list[int]]:
    """Indices of the trainable ``params``, last first, cut into buckets of about ``FIRST_BUCKET_BYTES`` then
    ``BUCKET_BYTES`` bytes (a bucket never mixes devices or dtypes, so each is one coalesced call)."""
    buckets: list[list[int]] = []
    size, limit, key = 0, FIRST_BUCKET_BYTES, None
    for j in reversed(range(len(params))):
        p = params[j]
        if not p.requires_grad:
            continue
        k = (p.device, p.dtype)
        if buckets and size < limit and k == key:
            buckets[-1].append(j)
        else:
            if buckets:
                limit = BUCKET_BYTES
            buckets.append([j])
            size, key = 0, k
        size += p.numel() * p.element_size()
    return buckets


class GradBuckets:
    """Hooks on every lane's parameters that sum each bucket across the active lanes once it is full."""

    def __init__(self, params: Sequence[Sequence[nn.Parameter]]) -> None:
        self.params = params
        self.buckets = bucket_indices(params[0])
        self._bucket_of = {j: b for b, idx in enumerate(self.buckets) for j in idx}
        self._count = [0] * len(self.buckets)
        self._lanes: list[int] = []
        self._armed = False
        self._lock = threading.Lock()
        self._sum_lock = threading.Lock()
        self._handles = [
            p.register_post_accumulate_grad_hook(functools.partial(self._ready, j))
            for lane in params
            for j, p in enumerate(lane)
            if j in self._bucket_of
        ]

    def arm(self, lanes: Sequence[int]) -> None:
        """Sum buckets during the next backward of ``lanes`` (the lanes that run it)."""
        self._count = [0] * len(self.buckets)
        self._lanes = list(lanes)
        self._armed = True

    def disarm(self) -> None:
        self._armed = False

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _ready(self, j: int, _param: torch.Tensor) -> None:
        if not self._armed:
            return
        b = self._bucket_of[j]
        with self._lock:
            self._count[b] += 1
            full = self._count[b] == len(self.buckets[b]) * len(self._lanes)
        if full:
            with self._sum_lock:
                self._sum(self.buckets[b])

    @torch.no_grad()
    def _sum(self, idx: list[int]) -> None:
        """Add the other active lanes' gradients of ``idx`` into the model's (lane 0's), then clear theirs."""
        master = self.params[0]
        others = [lane for lane in self._lanes if lane != 0]
        if any(is_sparse(self.params[lane][j].grad) for lane in (0, *others) for j in idx):
            # Embedding(sparse=True): sparse gradients are summed as sparse tensors, one by one
            for j in idx:
                for lane in others:
                    g = self.params[lane][j].grad
                    if g is not None:
                        add_grad(master[j], g)
                    self.params[lane][j].grad = None
            return
        for j in idx:
            if master[j].grad is None:  # lane 0 sat this backward out (and no earlier micro-batch ran it)
                master[j].grad = torch.zeros_like(master[j])
        sum_into([master[j].grad for j in idx], [[self.params[lane][j].grad for j in idx] for lane in others])
        for lane in others:
            for j in idx:
                self.params[lane][j].grad = None
