"""Summing gradients across replicas and copying weights into them, many tensors per call.

Two jobs, one code path for CPU lanes and GPUs:

- ``sum_into(dst, srcs)``: ``dst[j] += srcs[k][j]`` for every replica ``k`` — the gradient reduce;
- ``copy_into(dsts, src)``: ``dsts[k][j].copy_(src[j])`` — bringing replicas up to the master's weights.

Where every tensor lives on one device (CPU lanes, or several replicas on one GPU) these are torch's
multi-tensor ``_foreach`` kernels: one call per replica, no flattening, no copy. Where the replicas
sit on different GPUs they are torch.cuda.comm's coalesced collectives (``reduce_add_coalesced`` /
``broadcast_coalesced``: small tensors packed into buffers of ``bucket_bytes``, NCCL where it
applies), which is also what ``torch.nn.parallel.replicate`` and ``DataParallel`` use.

Dense tensors only: a sparse gradient (``Embedding(sparse=True)``) is summed by its caller one tensor at a
time, as a sparse tensor (``engine/tensors/grads.py``: ``add_grad``), never through these buffers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

BUCKET_BYTES = 25 * 1024 * 1024
"""Coalescing buffer for cross-GPU transfers (DDP's default bucket size)."""


def sum_into(dst: Sequence[torch.Tensor], srcs: Sequence[Sequence[torch.Tensor]]) -> None:
    """Add every list in ``srcs`` into ``dst`` in place, in the order given (a fixed order: the same
    sum on every run)."""
    if not dst or not srcs:
        return
    device = dst[0].device
    if device.type == "cuda" and any(s[0].device != device for s in srcs):
        reduced = torch.cuda.comm.reduce_add_coalesced([list(dst), *map(list, srcs)], device.index, BUCKET_BYTES)
        torch._foreach_copy_(list(dst), list(reduced))
        return
    for src in srcs:
        torch._foreach_add_(list(dst), list(src))


def copy_into(dsts: Sequence[Sequence[torch.Tensor]], src: Sequence[torch.Tensor]) -> None:
    """Copy ``src`` into every list in ``dsts`` in place (replicas keep their tensor objects)."""
    if not src or not dsts:
        return
    device = src[0].device
    remote = [d for d in dsts if d[0].device != device]
    for d in dsts:
        if d[0].device == device:
            torch._foreach_copy_(list(d), list(src))
    if not remote:
        return
    # One coalesced broadcast per other GPU, then a same-device copy into each replica there.
    targets = sorted({d[0].device.index for d in remote})
    copies = torch.cuda.comm.broadcast_coalesced(list(src), [device.index, *targets], BUCKET_BYTES)
    on = dict(zip(targets, copies[1:], strict=True))
    for d in remote:
        torch._foreach_copy_(list(d), list(on[d[0].device.index]))
