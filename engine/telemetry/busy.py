"""How long each CPU lane (or a ddp rank on the CPU) has computed, counting the work still running.

A lane's busy time used to be credited when its work finished: a step longer than a telemetry record
read 0 % for every record it spanned and then 100 % (capped) for the one it ended in, so utilization
showed 0 % while training and a lane that finished a moment after another looked idle. Here the
seconds of work in flight count at once, so each record gets the busy time that fell within it.

One backward through several lanes' graphs (the ``replicate`` strategy: autograd walks every lane's
graph in the calling thread, their nodes interleaved) is split by what runs: ``lane_backward`` hooks
every node of each lane's own graph, and the time from one node's start to the next node's is the
lane's whose node it is — measured, never a share assumed from the lanes' batch sizes. The hooks cost
about 10 µs a node (a 40-layer MLP's backward took 20 ms instead of 13), so ``BackwardShares``
measures the first ``first`` backwards and one in ``every`` after them, and splits the ones between by
each lane's median share over the last ``keep`` measured on the same lanes (a share is the lane's part
of the backward's own wall time, so the lanes' shares never add up to more than the backward took).
The median, not the last measure: on a busy machine the thread can be preempted inside one lane's node,
and that one measure would credit that lane with the wait for the next ``every`` backwards.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any


class BusyClock:
    """Cumulative busy seconds of ``n`` lanes; ``start(i)`` and ``stop(i)`` bracket lane i's work
    (``rate``: the share of that time that is lane i's, where lanes share one thread's work).

    Each lane's state is one tuple ``(done, since, rate)``, replaced whole: a lane's work runs in one
    thread at a time (its pool thread, or the calling thread), so each lane has one writer, and a reader
    in another thread (telemetry) takes each tuple at once, never a half-made update. No lock: this
    brackets every step's forward and backward."""

    def __init__(self, n: int) -> None:
        self._lanes: list[tuple[float, float | None, float]] = [(0.0, None, 1.0)] * n
        self._one: dict[int, LanesBusy] = {}

    def start(self, lane: int, rate: float = 1.0) -> None:
        self._lanes[lane] = (self._lanes[lane][0], time.perf_counter(), rate)

    def lanes(self, lanes: Sequence[int]) -> LanesBusy:
        """A ``with`` block counted as busy time of each of ``lanes`` (a class, not a generator: it
        brackets every one-lane forward and backward, where a generator's set-up was a visible cost;
        one lane's is made once)."""
        if len(lanes) == 1:
            one = self._one.get(lanes[0])
            if one is None:
                one = self._one[lanes[0]] = LanesBusy(self, (lanes[0],))
            return one
        return LanesBusy(self, lanes)

    def stop(self, lane: int) -> None:
        done, since, rate = self._lanes[lane]
        if since is not None:
            self._lanes[lane] = (done + rate * (time.perf_counter() - since), None, rate)

    def switch(self, old: int | None, new: int | None) -> None:
        """Stop lane ``old`` and start lane ``new`` at one instant (None: no lane)."""
        now = time.perf_counter()
        if old is not None:
            done, since, _ = self._lanes[old]
            if since is not None:
                self._lanes[old] = (done + now - since, None, 1.0)
        if new is not None:
            self._lanes[new] = (self._lanes[new][0], now, 1.0)

    def seconds(self) -> list[float]:
        """Each lane's busy seconds so far, its running work included up to now."""
        lanes = list(self._lanes)  # first: no lane's start is then later than ``now``
        now = time.perf_counter()
        return [d + (r * (now - s) if s is not None else 0.0) for d, s, r in lanes]


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


class BackwardShares:
    """Each lane's part of one backward through several lanes' graphs, on ``clock``: measured node by
    node (``lane_backward``) on the first ``first`` backwards and on one in ``every`` after them; the
    backwards between are credited to the lanes at each lane's median share over the last ``keep``
    measured for the same lanes, while they run (the module's docstring says why the median)."""

    def __init__(self, clock: BusyClock, every: int = 10, first: int = 3, keep: int = 5) -> None:
        self.clock = clock
        self.every = every
        self.first = first
        self.count = 0
        self.history: dict[tuple[int, ...], deque[list[float]]] = {}  # by the lanes that took part
        self.shares: dict[tuple[int, ...], list[float]] = {}  # the shares a backward not measured gets
        self.keep = keep
        self.measured = 0  # backwards measured node by node (the tests read it)

    def measures(self, count: int) -> bool:
        """Whether the backward numbered ``count`` (from 0) is measured node by node."""
        return count < self.first or count % self.every == 0

    @contextmanager
    def backward(self, root: Any, lane_roots: Sequence[tuple[int, Any]], stop: Callable[[Any], bool]) -> Iterator[None]:
        lanes = tuple(lane for lane, _ in lane_roots)
        shares = self.shares.get(lanes)
        measure = shares is None or self.measures(self.count)
        self.count += 1
        if measure:
            before, t0 = self.clock.seconds(), time.perf_counter()
            with lane_backward(self.clock, root, lane_roots, stop):
                yield
            wall, after = time.perf_counter() - t0, self.clock.seconds()
            if wall > 0:
                history = self.history.setdefault(lanes, deque(maxlen=self.keep))
                history.append([min(1.0, (after[lane] - before[lane]) / wall) for lane in lanes])
                self.shares[lanes] = median_shares(history)
                self.measured += 1
            return
        for lane, rate in zip(lanes, shares, strict=True):
            self.clock.start(lane, rate)
        try:
            yield
        finally:
            for lane in lanes:
                self.clock.stop(lane)


def median_shares(history: Sequence[Sequence[float]]) -> list[float]:
    """Each lane's median share over ``history`` (one list of the lanes' shares per measured backward),
    scaled down where the medians add up to more than 1 (they come from different backwards)."""
    medians = [statistics.median(column) for column in zip(*history, strict=True)]
    total = sum(medians)
    return [m / total for m in medians] if total > 1.0 else medians


class LanesBusy:
    """``BusyClock.lanes``: starts the lanes' clocks on entry and stops them on exit (``start`` and
    ``stop`` written out: this brackets every step's forward and backward)."""

    __slots__ = ("lanes_", "state")

    def __init__(self, clock: BusyClock, lanes: Sequence[int]) -> None:
        self.state, self.lanes_ = clock._lanes, lanes

    def __enter__(self) -> None:
        state, now = self.state, time.perf_counter()
        for lane in self.lanes_:
            state[lane] = (state[lane][0], now, 1.0)

    def __exit__(self, *exc: object) -> None:
        state, now = self.state, time.perf_counter()
        for lane in self.lanes_:
            done, since, rate = state[lane]
            if since is not None:
                state[lane] = (done + rate * (now - since), None, rate)
