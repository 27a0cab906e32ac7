"""Timing the phases of a step without forcing a device sync at every phase."""

from __future__ import annotations

import itertools
import time
from collections import defaultdict

import torch

PHASES = ("data", "scatter", "replicate", "forward", "loss", "backward", "reduce", "optimizer")
"""A step's phases in the order they run. ``replicate`` is the per-step copy of the model
(ReplicateEachStep) or the copy of the new weights into persistent replicas (PersistentReplicas);
``reduce`` is PersistentReplicas' gradient sum across devices (ReplicateEachStep sums inside backward)."""


class PhaseTimer:
    """Wall-clock phase timer for CPU lanes: CPU work is synchronous, so perf_counter is exact.

    ``mark(phase)`` ends the running phase and starts ``phase``; ``mark(None)`` ends it.
    ``read()`` returns mean milliseconds per step for each phase since the last read. A mark only
    notes the phase and the time (it runs several times a step); ``read`` sums them.
    """

    FOLD = 4096  # marks kept before they are summed (a long log window's marks take no more room)

    def __init__(self) -> None:
        self._totals: dict[str, float] = defaultdict(float)
        self._steps = 0
        self._marks: list[tuple[str | None, float]] = []

    def mark(self, phase: str | None) -> None:
        self._marks.append((phase, _now()))

    def mark_host(self, phase: str) -> None:
        """Start ``phase``, timed on the host until the next mark (waiting for the next batch is
        measured on the host, also on GPUs). On the CPU every phase is: a plain mark."""
        self._marks.append((phase, _now()))

    def end_step(self) -> None:
        self.mark(None)
        self._steps += 1
        if len(self._marks) > self.FOLD:
            self._fold()

    def _fold(self) -> None:
        """Sum the marks into the phases' totals; the running phase's start stays."""
        marks, totals = self._marks, self._totals
        for (phase, t0), (_, t1) in itertools.pairwise(marks):
            if phase is not None:
                totals[phase] += t1 - t0
        self._marks = marks[-1:] if marks and marks[-1][0] is not None else []

    def read(self) -> dict[str, float]:
        self._fold()
        steps = max(self._steps, 1)
        out = {p: 1000.0 * self._totals.get(p, 0.0) / steps for p in PHASES}
        self._totals.clear()
        self._steps = 0
        return out


_now = time.perf_counter


class NoTimer(PhaseTimer):
    """Times nothing (evaluation, where no step's phases are read)."""

    def mark(self, phase: str | None) -> None:
        pass

    def mark_host(self, phase: str) -> None:
        pass


class CudaPhaseTimer(PhaseTimer):
    """Phase timer from CUDA events on the output device's stream, resolved only at ``read()``.

    Recording an event does not synchronize; the one sync happens at log time, where the trainer
    reads the loss anyway.
    """

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self._device = device
        self._pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._start: torch.cuda.Event | None = None
        self._phase: str | None = None
        self._host: tuple[str, float] | None = None

    def mark_host(self, phase: str) -> None:
        self.mark(None)
        self._host = (phase, time.perf_counter())

    def mark(self, phase: str | None) -> None:
        if self._host is not None:
            host, t0 = self._host
            self._totals[host] += time.perf_counter() - t0
            self._host = None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self._device))
        if self._phase is not None and self._start is not None:
            self._pending.append((self._phase, self._start, ev))
        self._phase, self._start = phase, ev

    def read(self) -> dict[str, float]:
        if self._pending:
            self._pending[-1][2].synchronize()
        for phase, a, b in self._pending:
            self._totals[phase] += a.elapsed_time(b) / 1000.0
        self._pending.clear()
        return super().read()
