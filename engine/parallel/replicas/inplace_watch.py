"""A forward that changes parameters in place (``Embedding(max_norm=...)``), on persistent replicas.

The rule is the lanes' in-place rule (engine/parallel/replicas/inplace.py): on one device the forward changes the parameter
once, for the whole batch; on lanes each lane changes its own copy for its own shard, so the lanes'
changes are merged element by element in lane order (two lanes changing one element to different
values is refused), and where a lane computed with values other than the merged ones, the forward runs
again from the merged values, which must then settle (a change that, applied again, changes nothing
beyond rounding).

Persistent replicas have no untouched original to merge against (lane 0's replica is the model, and it
ran the forward too), so ``InplaceWatch`` keeps one: at the first forward after the replicas are built
it copies every parameter of the model and learns which ones the forward changes; from then on it
copies only those, before each forward. A model whose forward changes none pays one integer read per
parameter and lane. A parameter that starts changing only later (nothing was copied) is refused with
one line naming it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from multilane.engine.parallel.replicas.inplace import merge_lane_writes
from torch import nn


class InplaceForwardError(RuntimeError):
    """A forward's in-place change of a parameter that persistent replicas cannot reproduce."""


class InplaceWatch:
    """Watches every lane's parameters around a forward (``params[lane][j]``, lane 0's are the model's)."""

    def __init__(self, params: Sequence[Sequence[nn.Parameter]], name: Callable[[int], str], lane_names: Sequence[str]):
        self.params = params
        self.name = name
        self.lane_names = list(lane_names)
        self.known: list[int] | None = None
        """Indices of the parameters the forward changes in place; None until the first forward."""
        self._originals: dict[int, torch.Tensor] = {}
        self._versions: list[list[int]] = []

    @property
    def may_rerun(self) -> bool:
        """Whether the next forward may have to run again (until the first forward, or for a model that
        changes parameters in place)."""
        return self.known is None or bool(self.known)

    def before(self, lanes: Sequence[int]) -> None:
        """Keep what the forward of ``lanes`` may change: the originals and every version counter."""
        master = self.params[0]
        idx = range(len(master)) if self.known is None else self.known
        self._originals = {j: master[j].detach().clone() for j in idx}
        self._versions = [[p._version for p in self.params[lane]] for lane in lanes]

    def after(self, lanes: Sequence[int]) -> bool:
        """Merge what the forward changed into every replica; True when the forward must run again."""
        touched = self._touched(lanes)
        if self.known is None:
            self.known = touched
        if not touched:
            return False
        rerun = False
        with torch.no_grad():
            for j in touched:
                if j not in self._originals:
                    raise InplaceForwardError(
                        f"the model's forward changed parameter '{self.name(j)}' in place after the first "
                        "step, which persistent replicas learn such parameters from; "
                        'use devices.strategy = "replicate"'
                    )
                merged = self._merge(j, lanes)
                for lane, ps in enumerate(self.params):
                    if not torch.equal(ps[j].detach(), merged.to(ps[j].device)):
                        ps[j].copy_(merged)
                        rerun = rerun or lane in lanes
        return rerun

    def settled(self, lanes: Sequence[int]) -> None:
        """After the second forward: no lane may have changed the merged values again, beyond rounding."""
        master = self.params[0]
        for j in self._touched(lanes):
            ref = master[j].detach()
            rtol = 8 * torch.finfo(ref.dtype).eps if ref.is_floating_point() else 0.0
            for lane in lanes:
                if not torch.allclose(self.params[lane][j].detach().to(ref.device), ref, rtol=rtol, atol=0.0):
                    raise InplaceForwardError(
                        f"the forward changes parameter '{self.name(j)}' in place again after the engine "
                        f"applied every lane's change (seen on {self.lane_names[lane]}): a change that does not "
                        "settle cannot be split across lanes; train this model on one device"
                    )

    def _touched(self, lanes: Sequence[int]) -> list[int]:
        return sorted(
            {
                j
                for lane, before in zip(lanes, self._versions, strict=True)
                for j, p in enumerate(self.params[lane])
                if p._version != before[j]
            }
        )

    def _merge(self, j: int, lanes: Sequence[int]) -> torch.Tensor:
        copies = [(self.lane_names[lane], self.params[lane][j]) for lane in lanes]
        return merge_lane_writes(self._originals[j], copies, self.name(j), InplaceForwardError)
