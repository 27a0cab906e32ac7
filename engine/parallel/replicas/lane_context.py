"""What a lane's function runs inside: its random stream, and a group to exchange values with the other lanes.

``lane_apply`` wraps each lane's function so that, in the lane's own thread:

- the lane draws random numbers from its own stream (``lane_rng``);
- ``current_lane()`` gives the lane's context, whose ``exchange()`` hands a value to every other lane
  of the same call and returns all of them in lane order (synchronized BatchNorm uses it);
- a lane that fails releases the others from any exchange they wait in, so a failing lane ends the
  call instead of hanging it.

The same wrapper runs inside torch's ``parallel_apply`` on GPUs and inside CPU lanes' threads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from multilane.engine.parallel.replicas.lane_rng import LaneRandom, LaneRandomnessError, LaneSession

# A lane that waits longer than this for the others at an exchange gives up (a lane stuck or gone).
EXCHANGE_TIMEOUT_S = 600.0

_local = threading.local()


class LaneSyncError(RuntimeError):
    """Lanes could not exchange values: another lane failed, or they took different paths."""


class LaneGroup:
    """The lanes of one call, meeting at numbered exchanges (one barrier per exchange)."""

    def __init__(self, names: Sequence[str], timeout_s: float = EXCHANGE_TIMEOUT_S) -> None:
        self.names = list(names)
        self.size = len(self.names)
        self._barrier = threading.Barrier(self.size, timeout=timeout_s)
        self._lock = threading.Lock()
        self._slots: dict[int, list[Any]] = {}
        self._done: dict[int, int] = {}  # position -> exchanges it made, once finished
        self._entered = 0  # the highest exchange any lane has entered
        self._why: str | None = None

    def exchange(self, position: int, number: int, key: Any, value: Any) -> list[Any]:
        with self._lock:
            self._entered = max(self._entered, number + 1)
            short = [self.names[p] for p, n in self._done.items() if n <= number]
            if short and self._why is None:
                self._why = (
                    f"{self.names[position]} reached exchange {number + 1} ({key}) but "
                    f"{', '.join(short)} finished before it: lanes took different paths through the model"
                )
                self._barrier.abort()
            self._slots.setdefault(number, [None] * self.size)[position] = (key, value)
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            raise LaneSyncError(self._why or "timed out waiting for the other lanes") from None
        slot = self._slots[number]
        keys = {k for k, _ in slot}
        if len(keys) != 1:
            raise LaneSyncError(f"lanes took different paths through the model: exchange {number + 1} met at {keys}")
        return [v for _, v in slot]

    def abort(self, why: str) -> None:
        with self._lock:
            if self._why is None:
                self._why = why
        self._barrier.abort()

    def finished(self, position: int, exchanges: int) -> None:
        with self._lock:
            self._done[position] = exchanges
            if self._entered > exchanges and self._why is None:
                self._why = (
                    f"{self.names[position]} finished after {exchanges} exchange(s) while another lane waits "
                    f"at exchange {self._entered}: lanes took different paths through the model"
                )
                self._barrier.abort()


class LaneContext:
    """A running lane: which lane it is, among how many, and how to reach the others."""

    def __init__(self, lane: int, position: int, group: LaneGroup, rng: LaneSession) -> None:
        self.lane, self.position, self.group, self.rng = lane, position, group, rng
        self.exchanges = 0

    @property
    def size(self) -> int:
        """How many lanes take part in this call."""
        return self.group.size

    def exchange(self, key: Any, value: Any) -> list[Any]:
        """Give ``value`` to every lane of this call; return every lane's value, in lane order.

        Every lane must call it the same number of times in the same order (``key`` names the call
        site, to catch lanes that took different paths). The lane's hold on the random generators is
        let go while it waits, so lanes that run one at a time for randomness cannot deadlock here.
        """
        number = self.exchanges
        self.exchanges += 1
        self.rng.pause()
        try:
            return self.group.exchange(self.position, number, key, value)
        finally:
            self.rng.resume()


def current_lane() -> LaneContext | None:
    """The context of the lane running in this thread; None outside a multi-lane call."""
    return getattr(_local, "lane", None)


class _InLane:
    def __init__(self, fn: Callable[..., Any], ctx: LaneContext) -> None:
        self.fn, self.ctx = fn, ctx

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        ctx = self.ctx
        previous = current_lane()
        _local.lane = ctx
        try:
            with ctx.rng:
                return self.fn(*args, **kwargs)
        except BaseException as e:
            ctx.group.abort(f"{ctx.group.names[ctx.position]} failed: {type(e).__name__}: {e}")
            raise
        finally:
            ctx.group.finished(ctx.position, ctx.exchanges)
            _local.lane = previous


def lane_apply(
    parallel_apply: Callable[..., list[Any]],
    random: LaneRandom,
    kind: str,
    fns: Sequence[Callable[..., Any]],
    inputs: Sequence[Any],
    kwargs: Sequence[dict[str, Any]] | None,
    lanes: Sequence[int],
    names: Sequence[str],
) -> list[Any]:
    """``parallel_apply(fns, inputs, kwargs, lanes)`` with each lane in its context (module docstring).

    ``kind`` names the sort of call ("train", "eval", "loss"): each kind is probed for randomness apart.
    """
    locked = random.locked(kind)
    group = LaneGroup([names[lane] for lane in lanes])
    contexts = [LaneContext(lane, i, group, random.session(lane, locked)) for i, lane in enumerate(lanes)]
    before = None if locked else random.snapshot(lanes)
    outputs = parallel_apply([_InLane(f, c) for f, c in zip(fns, contexts, strict=True)], inputs, kwargs, lanes)
    if locked:
        random.record(kind, any(c.rng.drew for c in contexts))
    elif before is not None and random.drew_since(before):
        # The lanes drew from the shared generators at once: take the draws back (the caller runs
        # the call again, now locked, each lane on its own stream).
        random.restore(before)
        random.record(kind, True)
        raise LaneRandomnessError(f"the model drew random numbers in a {kind} call that ran unlocked")
    return outputs
