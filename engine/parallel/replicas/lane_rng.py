"""Each lane its own random stream, so dropout reproduces from the seed and checkpointing recomputes it exactly.

torch draws dropout masks from a process-wide generator per device: every CPU lane shares the one CPU
generator, and two replicas on one GPU (``cuda:0,cuda:0``) share that GPU's. Lanes running at once
would draw from it in whatever order their threads happen to run, and ``torch.utils.checkpoint``,
which saves the generator's state when a region starts and replays it in backward, would replay a
state other lanes had moved on from: a different mask, a silently wrong gradient.

So a lane's forward runs with the default generators *swapped* to that lane's own state, under one
lock: while lane i runs, the generators are lane i's alone; when it is done (or waits for the other
lanes, see ``lane_context``) its state is saved and the generators are given back. Lane 0 draws from
the default generators themselves, which the run seeds (so one lane is exactly a plain script with
``torch.manual_seed``); lane i > 0 starts from its own seed, derived from the run's seed and i. The
generators a lane owns are the CPU's and, on a GPU, its device's.

The lock serializes lane forwards, so it is only taken where the model draws random numbers: the
first call of each kind (training forward, evaluation forward, loss) runs locked and tells whether
any lane drew; if none did, later calls of that kind run in parallel with no lock, and a comparison
of the default generators' states after each call (microseconds) catches a model that starts
drawing later (a dropout rate scheduled up from 0). Such a call's draws raced, so it is taken back:
the generators get their states from before it, and the step strategy runs the call again, locked,
on fresh replicas (``LaneRandomnessError`` is how it learns of it; replicas update copies of the
buffers, and their own copies of the parameters, so the model is untouched). The result is the
run that was locked from the start.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from typing import Any

import torch


class LaneRandomnessError(RuntimeError):
    """A model drew random numbers in a call whose lanes ran unlocked (the call must run again, locked)."""


def lane_seed(seed: int, lane: int) -> int:
    """The seed of lane ``lane``'s stream: a hash of the run's seed and the lane (lane 0: the run's own)."""
    if lane == 0:
        return seed
    digest = hashlib.blake2b(f"multilane-lane:{seed}:{lane}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # < 2**63: what every generator takes


def _generators(device: torch.device) -> list[torch.Generator]:
    """The default generators a lane on ``device`` draws from: the CPU's, and its GPU's."""
    gens = [torch.default_generator]
    if device.type == "cuda":
        torch.cuda.init()  # default_generators is filled at CUDA's (lazy) init; a no-op after it
        gens.append(torch.cuda.default_generators[device.index if device.index is not None else 0])
    return gens


class LaneRandom:
    """Per-lane random streams for the lanes of one backend (see the module docstring)."""

    def __init__(self, devices: Sequence[torch.device], seed: int = 0) -> None:
        self.devices = list(devices)
        self.seed = seed
        self._lock = threading.Lock()
        # Lane i > 0: its saved generator states, created at its first draw (None until then).
        self._states: list[list[torch.Tensor] | None] = [None] * len(self.devices)
        # Per kind of call: None until probed, then whether it draws (and so runs locked).
        self._draws: dict[str, bool] = {}

    # -- the session a lane runs in -----------------------------------------------------------
    def locked(self, kind: str) -> bool:
        """Whether calls of ``kind`` run with the lock (until probed, and once they are seen drawing)."""
        return self._draws.get(kind, True)

    def session(self, lane: int, locked: bool) -> LaneSession:
        return LaneSession(self, lane, locked)

    def snapshot(self, lanes: Sequence[int]) -> list[tuple[torch.Generator, torch.Tensor]]:
        """The default generators the lanes use, with their states (see ``drew_since``, ``restore``)."""
        seen: dict[tuple, torch.Generator] = {}
        for lane in lanes:
            for g in _generators(self.devices[lane]):
                seen.setdefault((g.device.type, g.device.index), g)
        return [(g, g.get_state()) for g in seen.values()]

    @staticmethod
    def drew_since(snapshot: list[tuple[torch.Generator, torch.Tensor]]) -> bool:
        return any(_changed([state], [g.get_state()]) for g, state in snapshot)

    @staticmethod
    def restore(snapshot: list[tuple[torch.Generator, torch.Tensor]]) -> None:
        for g, state in snapshot:
            g.set_state(state)

    def mark(self, lanes: Sequence[int]) -> tuple[list, list]:
        """Where every lane's stream stands now, to ``rewind`` to (a forward replayed draws again the same)."""
        return self.snapshot(lanes), list(self._states)

    def rewind(self, mark: tuple[list, list]) -> None:
        defaults, states = mark
        self.restore(defaults)
        self._states = list(states)

    def record(self, kind: str, drew: bool) -> None:
        """After a probing (locked) call: remember whether this kind of call draws."""
        if self._draws.get(kind) is None or drew:
            self._draws[kind] = drew

    # -- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Every lane's generator states (lane 0's are the default generators'), for a checkpoint."""
        lanes: list[list[torch.Tensor] | None] = [_states(self.devices[0])]
        lanes += [None if s is None else [t.clone() for t in s] for s in self._states[1:]]
        # Which kinds of call draw is not saved: a resumed run probes again (results do not depend on it).
        return {"seed": self.seed, "lanes": lanes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        lanes = state.get("lanes") or []
        if len(lanes) != len(self.devices):
            raise ValueError(f"lane random state for {len(lanes)} lanes, this run has {len(self.devices)}")
        if lanes[0] is not None:
            for g, s in zip(_generators(self.devices[0]), lanes[0], strict=False):
                g.set_state(s)
        self._states = [None] + [None if s is None else list(s) for s in lanes[1:]]

    # -- used by LaneSession --------------------------------------------------------------------
    def _swap_in(self, lane: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Give the default generators lane ``lane``'s state; return (what they held, the lane's state)."""
        gens = _generators(self.devices[lane])
        saved = [g.get_state() for g in gens]
        state = self._states[lane]
        if state is None:  # the lane's first draw: seed its stream
            for g in gens:
                g.manual_seed(lane_seed(self.seed, lane))
            state = [g.get_state() for g in gens]
        else:
            for g, s in zip(gens, state, strict=True):
                g.set_state(s)
        return saved, state

    def _swap_out(self, lane: int, saved: list[torch.Tensor]) -> list[torch.Tensor]:
        """Save lane ``lane``'s state and give the generators back what they held; return the lane's state."""
        gens = _generators(self.devices[lane])
        now = [g.get_state() for g in gens]
        self._states[lane] = now
        for g, s in zip(gens, saved, strict=True):
            g.set_state(s)
        return now


def _states(device: torch.device) -> list[torch.Tensor]:
    return [g.get_state() for g in _generators(device)]


def _changed(before: list[torch.Tensor], after: list[torch.Tensor]) -> bool:
    return any(a.shape != b.shape or not torch.equal(a, b) for a, b in zip(before, after, strict=True))


class LaneSession:
    """A lane's hold on its random stream while it runs; ``pause``/``resume`` around a wait for other lanes.

    Unlocked (a kind of call known not to draw), it does nothing.
    """

    def __init__(self, owner: LaneRandom, lane: int, locked: bool) -> None:
        self.owner, self.lane, self.locked = owner, lane, locked
        self.drew = False
        self._saved: list[torch.Tensor] | None = None
        self._before: list[torch.Tensor] | None = None

    def __enter__(self) -> LaneSession:
        self.resume()
        return self

    def __exit__(self, *exc: object) -> None:
        self.pause()

    def resume(self) -> None:
        if not self.locked:
            return
        self.owner._lock.acquire()
        try:
            if self.lane == 0:  # lane 0 draws from the default generators themselves
                self._before = _states(self.owner.devices[0])
            else:
                self._saved, self._before = self.owner._swap_in(self.lane)
        except BaseException:
            self.owner._lock.release()
            raise

    def pause(self) -> None:
        if not self.locked or self._before is None:
            return
        try:
            if self.lane == 0:
                after = _states(self.owner.devices[0])
            else:
                assert self._saved is not None
                after = self.owner._swap_out(self.lane, self._saved)
            self.drew = self.drew or _changed(self._before, after)
        finally:
            self._saved = self._before = None
            self.owner._lock.release()
