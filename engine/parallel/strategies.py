"""Which step strategy a run uses (``devices.strategy``)."""

from __future__ import annotations

from multilane.engine.parallel.backend import Backend
from multilane.engine.parallel.persistent import PersistentReplicas
from multilane.engine.parallel.strategy import ReplicateEachStep

STRATEGIES: dict[str, type[ReplicateEachStep]] = {
    "replicate": ReplicateEachStep,
    "persistent": PersistentReplicas,
}
"""The in-process strategies by their config name; each runs the four primitives of one backend."""


def make_strategy(name: str, backend: Backend, precision: str = "fp32", seed: int = 0) -> ReplicateEachStep:
    """The strategy called ``name`` over ``backend`` (``seed``: the lanes' random streams); ValueError
    naming the known ones otherwise."""
    cls = STRATEGIES.get(name)
    if cls is None:
        raise ValueError(f"unknown strategy {name!r}; known: {', '.join(STRATEGIES)}")
    return cls(backend, precision, seed)
