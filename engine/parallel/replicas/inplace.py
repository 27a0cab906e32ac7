"""A forward that changes parameters in place (``Embedding(max_norm=...)``), made equal to one device.

On one device such a forward changes the parameter itself, once, for the whole batch, and the rest of
the forward (a tied output layer) reads the changed values. On lanes, each lane changes its own copy
(true replicas: race-free) for its own shard only. The engine then:

1. merges the lanes' changes, element by element, in lane order, and writes them into the original
   parameter (an element two lanes changed to different values cannot be merged: refused);
2. if every lane's copy already held the merged values, each lane computed with what one device would
   have used: done;
3. otherwise (a lane read rows that other lanes' shards changed, as a tied output layer does) it runs
   the forward again from the merged parameters, which equals one device when the change, applied
   again, changes nothing beyond rounding (``Embedding(max_norm)``'s renormalisation does not); a
   forward that changes the parameters again is refused with one line, since no split of the batch
   can reproduce it. The original keeps the merged values of step 1.

Only parameters whose version counter moved during the forward are looked at: a model that changes no
parameter pays for one integer read per parameter and lane. Which models write: learned from a model's
first multi-lane forward, which runs on private copies. A model that wrote none then gets views of the
original parameters on the lanes of their own device (no copy per step); a view shares the original's
version counter, so a later write is still seen, but the lanes held that parameter shared: refused.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class InplaceParameterError(RuntimeError):
    """A forward's in-place change of a parameter that no split of the batch can reproduce."""


def versions(replica_params: Sequence[Sequence[torch.Tensor]]) -> list[list[int]]:
    return [[p._version for p in ps] for ps in replica_params]


def changed(replica_params: Sequence[Sequence[torch.Tensor]], before: list[list[int]]) -> list[int]:
    """Indices of the parameters some lane's forward wrote to (by version counter)."""
    return sorted(
        {j for ps, vs in zip(replica_params, before, strict=True) for j, p in enumerate(ps) if p._version != vs[j]}
    )


def merge_lane_writes(
    orig: torch.Tensor,
    copies: Sequence[tuple[str, torch.Tensor]],
    param_name: str,
    error: type[RuntimeError] = InplaceParameterError,
) -> torch.Tensor:
    """The lanes' in-place writes to one parameter (``copies``: each lane's name and its copy) merged
    over ``orig``; ``error`` if two lanes wrote different values to one element."""
    merged = orig.clone()
    claimed = torch.zeros_like(orig, dtype=torch.bool)
    owner = torch.full_like(orig, -1, dtype=torch.long)
    for k, (lane_name, copy) in enumerate(copies):
        copy = copy.detach().to(orig.device)
        diff = copy != orig
        clash = diff & claimed & (copy != merged)
        if bool(clash.any()):
            other = copies[int(owner[clash].flatten()[0])][0]
            raise error(
                f"parameter '{param_name}' was changed in place to different values on lanes {other} and "
                f"{lane_name}: a data-parallel step cannot reproduce that; train this model on one device"
            )
        merged[diff] = copy[diff]
        owner[diff & ~claimed] = k
        claimed |= diff
    return merged


def merge_into_original(
    model: nn.Module, replica_params: Sequence[Sequence[torch.Tensor]], indices: list[int], lane_names: list[str]
) -> bool:
    """Write the lanes' merged changes into ``model``'s parameters; True when every lane computed with
    the merged values already (no second forward needed)."""
    params = list(model.parameters())
    all_agree = True
    for j in indices:
        orig = params[j].detach()
        merged = merge_lane_writes(
            orig, list(zip(lane_names, (ps[j] for ps in replica_params), strict=True)), _name(model, params[j])
        )
        all_agree = all_agree and all(torch.equal(ps[j].detach().to(orig.device), merged) for ps in replica_params)
        with torch.no_grad():
            params[j].copy_(merged)
    return all_agree


def check_settled(
    model: nn.Module, replica_params: Sequence[Sequence[torch.Tensor]], before: list[list[int]], lane_names: list[str]
) -> None:
    """After the second forward: no lane may have changed a parameter's values again, beyond rounding.

    Rounding: a renormalised row's norm, computed again, can land a few units in the last place above
    ``max_norm`` in float32 and be scaled once more; that is the noise of the dtype, not a new change.
    """
    params = list(model.parameters())
    for j in changed(replica_params, before):
        orig = params[j].detach()
        rtol = 8 * torch.finfo(orig.dtype).eps if orig.is_floating_point() else 0.0
        for lane, ps in enumerate(replica_params):
            if not torch.allclose(ps[j].detach().to(orig.device), orig, rtol=rtol, atol=0.0):
                raise InplaceParameterError(
                    f"the forward changes parameter '{_name(model, params[j])}' in place again after the "
                    f"engine applied every lane's change (seen on {lane_names[lane]}): a change that does "
                    "not settle cannot be split across lanes; train this model on one device"
                )


def late_write_error(model: nn.Module, indices: list[int]) -> InplaceParameterError:
    """A parameter written in forward by a model whose first forward wrote none: its lanes shared it."""
    params = list(model.parameters())
    return InplaceParameterError(
        f"parameter '{_name(model, params[indices[0]])}' was changed in place during this forward but not "
        "during the model's first one, so the lanes held it shared and this step cannot be trusted; a "
        "model that changes parameters in forward must do so from its first step"
    )


def _name(model: nn.Module, param: torch.Tensor) -> str:
    return next((n for n, p in model.named_parameters() if p is param), "?")
