"""How long each CPU lane (or a ddp rank on the CPU) has computed, counting the work still running.

A lane's busy time used to be credited when its work finished: a step longer than a telemetry record
read 0 % for every record it spanned and then 100 % (capped) for the one it ended in, so utilization
showed 0 % while training and a lane that finished a moment after another looked idle. Here the
seconds of work in flight count at once, so each record gets the busy time that fell within it.

One backward through several lanes' graphs (the ``replicate`` strategy: autograd walks every lane's
graph in the calling thread, their nodes interleaved) is split by what runs: ``lane_backward`` hooks
every node of each lane's own graph, and the time from one node's start to the next node's is the
lane's whose node it is — measured, never a share assumed from the lanes' batch sizes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any


class BusyClock:
    """Cumulative busy seconds of ``n`` lanes; ``start(i)`` and ``stop(i)`` bracket lane i's work."""

    def __init__(self, n: int) -> None:
        self._done = [0.0] * n
        self._since: list[float | None] = [None] * n
        self._lock = threading.Lock()

    def start(self, lane: int) -> None:
        with self._lock:
            self._since[lane] = time.perf_counter()

    def stop(self, lane: int) -> None:
        with self._lock:
            t0 = self._since[lane]
            if t0 is not None:
                self._done[lane] += time.perf_counter() - t0
                self._since[lane] = None

    def switch(self, old: int | None, new: int | None) -> None:
        """Stop lane ``old`` and start lane ``new`` at one instant (None: no lane)."""
        with self._lock:
            now = time.perf_counter()
            if old is not None:
                t0 = self._since[old]
                if t0 is not None:
                    self._done[old] += now - t0
                    self._since[old] = None
            if new is not None:
                self._since[new] = now

    def seconds(self) -> list[float]:
        """Each lane's busy seconds so far, its running work included up to now."""
        now = time.perf_counter()
        with self._lock:
            return [d + (now - s if s is not None else 0.0) for d, s in zip(self._done, self._since, strict=True)]


_SHARED = -1  # a node two lanes' graphs both reach: no one lane's work


def graph_owners(
    root: Any, lane_roots: Sequence[tuple[int, Any]], stop: Callable[[Any], bool]
) -> dict[Any, int | None]:
    """Each autograd node of a backward, with the lane whose graph holds it (None: no one lane's).

    ``lane_roots``: (lane, the grad_fn of that lane's loss). A lane's graph is every node reachable
    from its root, down to (not below) a ``stop`` node, such as the one node that sums every lane's
    gradients into the model's parameters, which is no lane's own work. ``root`` (the combined loss's
    grad_fn, or None) adds the nodes between it and the lanes', also no lane's."""
    owner: dict[Any, int] = {}
    for lane, start in lane_roots:
        stack = [start]
        while stack:
            node = stack.pop()
            if node is None:
                continue
            seen = owner.get(node)
            if seen in (lane, _SHARED):
                continue
            owner[node] = lane if seen is None else _SHARED
            if stop(node):
                owner[node] = _SHARED
                continue
            stack.extend(f for f, _ in node.next_functions)
    stack = [root]
    while stack:
        node = stack.pop()
        if node is None or node in owner:
            continue
        owner[node] = _SHARED
        if not stop(node):
            stack.extend(f for f, _ in node.next_functions)
    return {node: (None if o == _SHARED else o) for node, o in owner.items()}


@contextmanager
def lane_backward(
    clock: BusyClock, root: Any, lane_roots: Sequence[tuple[int, Any]], stop: Callable[[Any], bool]
) -> Iterator[None]:
    """Credit each lane of ``clock`` with the part of the backward run inside the block that its own
    graph's nodes take (``graph_owners``): a hook before every node switches the clock to that node's
    lane, or to no lane; at the end no lane runs. Nodes made during the backward (a checkpointed
    segment's recomputation) count for the lane whose node made them."""
    owner = graph_owners(root, lane_roots, stop)
    current: list[int | None] = [None]

    def hook_for(lane: int | None) -> Callable[[Any], None]:
        def hook(_grad_outputs: Any) -> None:
            if current[0] != lane:
                clock.switch(current[0], lane)
                current[0] = lane

        return hook

    hooks = {lane: hook_for(lane) for lane in set(owner.values())}
    handles = [node.register_prehook(hooks[lane]) for node, lane in owner.items()]
    try:
        yield
    finally:
        clock.switch(current[0], None)
        for h in handles:  # a graph kept for another backward must not credit lanes outside the block
            h.remove()
