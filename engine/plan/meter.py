"""The run's measured peak, to set beside its forecast at the end: the same measures as the probe.

- GPUs: ``torch.cuda.max_memory_allocated`` of each GPU from the first step to the run's end
  (evaluation and checkpoints included).
- CPU lanes: live tensor storage (measure.py), counted during the run's 2nd and 3rd steps (the 1st
  alone in a run of one step): the first steps whose optimizer state exists, as in the probe; and during
  the 2nd step of the second log window (``log_every + 2``), the first step that also holds what the NaN
  replay keeps once the optimizer has state (its copy at the first window's start was made before the
  optimizer had any: steps 2 and 3 alone measured 11 % under the run's true peak on digits at batch 64).
  Steps of the same shapes hold the same memory, so these stand for every full step; counting every
  step would cost an aten-op hook on all of them. A strategy whose first steps differ (ddp's reach probe,
  under ``no_sync``: DDP's buckets idle) has them let pass by the probe (``MemoryLine.settle``): the
  meter measures as many steps later (a shorter run: its last step).
- ddp and fsdp ranks (``RankPeakMeter``): each rank measures its own process (or GPU) at the same steps, against
  the forecast its launcher passed in ``MULTILANE_FORECAST``; rank 0's summary has a row per rank.
- fsdp's setup, a phase of its forecast: each rank builds the whole model, then shards it, so its memory
  holds the whole model and the first shards for a moment. On CPU lanes the rank counts from the model's
  build to the end of the sharding (``setup``); on a GPU ``max_memory_allocated`` up to the loop's start.
  The rank's measured peak is the larger of this and its steps' (with a small model on many ranks the
  setup is the run's peak).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from multilane.engine.plan import measure
from multilane.engine.plan.forecast import Forecast, gib, small_difference
from multilane.engine.telemetry.devices import Device

CPU_STEPS = (2, 3)
_NOTHING = contextlib.nullcontext()
FORECAST_ENV = "MULTILANE_FORECAST"
"""A ddp or fsdp launch: the forecast its launcher made (JSON), for each rank to set its own peak beside."""


class PeakMeter:
    """Made only when the run has a forecast: a run without one pays nothing."""

    def __init__(self, devices: list[Device], forecast: Forecast, total_steps: int | None = None) -> None:
        self.forecast = forecast
        self.cuda = [torch.device(n) for n in dict.fromkeys(d.name for d in devices if d.is_cuda)]
        self.count = None if self.cuda else measure.StorageCount()
        self.cpu_peak: int | None = None
        self.steps = set(CPU_STEPS)
        self.settle = max((x.get("settle", 0) for x in forecast.lines), default=0)  # steps the probe let pass

    def before_model(self) -> None:
        """Called once the data is loaded, before the model is built: what is alive now is not counted."""
        if self.count is not None:
            self.count.baseline()

    def start(self, total_steps: int, first_step: int, log_every: int = 1) -> None:
        """The loop begins (at ``first_step``, 0 for a new run) of ``total_steps``, logging every ``log_every``."""
        if self.cuda:
            measure.cuda_reset(self.cuda)
        steps = [s + self.settle for s in (*CPU_STEPS, first_step + log_every + 2)]
        wanted = [s for s in steps if first_step < s <= total_steps] or [min(total_steps, first_step + 1 + self.settle)]
        self.steps = set(wanted)

    def step(self, n: int, backend: Any) -> contextlib.AbstractContextManager[None]:
        """Around optimizer step ``n`` (1-based): a step not measured gets a shared no-op (every step
        passes here: no generator made for it)."""
        if self.count is None or n not in self.steps:
            return _NOTHING
        return self._measured_step(backend)

    @contextlib.contextmanager
    def _measured_step(self, backend: Any) -> Iterator[None]:
        assert self.count is not None
        with self._counting(backend):
            yield
        self.cpu_peak = max(self.cpu_peak or 0, self.count.peak)

    @contextlib.contextmanager
    def _counting(self, backend: Any) -> Iterator[None]:
        """Count this process's CPU tensors from what is alive now: ``count.peak`` is the block's peak."""
        assert self.count is not None
        self.count.add_live()
        self.count.reset_peak()
        with measure.CpuCounting(self.count, backend):
            yield

    def report(self) -> dict[str, Any] | None:
        """``{"memory": {name: {"forecast", "measured"}}}``-style rows, or None when nothing was measured."""
        measured: dict[str, int] = {}
        if self.cuda:
            with contextlib.suppress(RuntimeError):
                measured = {str(d): p for d, p in zip(self.cuda, measure.cuda_peaks(self.cuda), strict=True)}
        elif self.cpu_peak is not None:
            measured = {"cpu": self.cpu_peak}
        rows = {}
        for need in self.forecast.needs:
            if need.name in measured:
                rows[need.name] = {"forecast": need.need, "measured": measured[need.name]}
        return rows or None


class RankPeakMeter(PeakMeter):
    """One ddp or fsdp rank's peak, by the same measures (this process's tensors on CPU lanes; its GPU's
    ``max_memory_allocated``), set beside the forecast for its share of the batch. Every rank measures the
    same steps; after the last of them the ranks' peaks are gathered (``all_gather_object``), so rank 0's
    summary has one row per rank."""

    def __init__(self, device: Device, forecast: Forecast, rank: int, world: int, weights: list[float] | None) -> None:
        super().__init__([device], forecast)
        from multilane.engine.parallel.split import chunk_sizes
        from multilane.engine.plan.probe import MemoryLine

        d = next(x for x in forecast.lines if x["name"] in (device.name, "cpu"))
        line = MemoryLine(**{**d, "phases": {k: [tuple(p) for p in v] for k, v in d["phases"].items()}})
        shares = chunk_sizes(forecast.batch, world, weights)
        self.rank_forecast = [line.need(s) for s in shares]
        self.rank_peaks: list[int] | None = None
        self.has_setup = "setup" in line.phases  # fsdp's forecast counts its setup: so does the measure
        self.setup_peak: int | None = None

    @contextlib.contextmanager
    def setup(self) -> Iterator[None]:
        """Around fsdp's setup, from just after the model's build (its parameters, alive then, are counted)
        to the end of the sharding: on CPU lanes the peak of this process's tensors (on a GPU the loop's
        start reads it)."""
        if self.count is None or not self.has_setup:
            yield
            return
        with self._counting(None):
            yield
        self.setup_peak = self.count.peak

    def start(self, total_steps: int, first_step: int, log_every: int = 1) -> None:
        if self.cuda and self.has_setup:
            self.setup_peak = measure.cuda_peaks(self.cuda)[0]  # the setup's, before the steps' reset
        super().start(total_steps, first_step, log_every)

    @contextlib.contextmanager
    def step(self, n: int, backend: Any) -> Iterator[None]:
        with super().step(n, backend):
            yield
        if n == max(self.steps):
            import torch.distributed as dist

            peak = measure.cuda_peaks(self.cuda)[0] if self.cuda else self.cpu_peak
            if peak is not None and self.setup_peak is not None:
                peak = max(peak, self.setup_peak)
            peaks: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(peaks, peak)
            self.rank_peaks = peaks

    def report(self) -> dict[str, Any] | None:
        if self.rank_peaks is None:
            return None
        pairs = zip(self.rank_forecast, self.rank_peaks, strict=True)
        return {f"rank {r}": {"forecast": f, "measured": m} for r, (f, m) in enumerate(pairs) if m is not None}


def rank_meter(device: Device, rank: int, world: int, weights: list[float] | None) -> RankPeakMeter | None:
    """The rank's meter where its launcher made a forecast (``FORECAST_ENV``), else None."""
    import json
    import os

    text = os.environ.get(FORECAST_ENV)
    if not text:
        return None
    forecast = Forecast.from_dict(json.loads(text))
    # Several nodes: each launcher forecast its own node's devices, not this world's shares.
    if forecast.n_devices != world or not any(x["name"] in (device.name, "cpu") for x in forecast.lines):
        return None
    return RankPeakMeter(device, forecast, rank, world, weights)


def memory_lines(rows: dict[str, Any] | None) -> list[str]:
    """The summary's lines: "peak tensor memory cuda:0: 3.10 GiB measured, 3.02 GiB forecast (-2.6 %)"; below
    ``SMALL_PEAK`` the difference in bytes: "29.7 KiB measured, 3.7 KiB forecast (-26.0 KiB)"."""
    out = []
    for name, r in (rows or {}).items():
        m, f = r["measured"], r["forecast"]
        err = small_difference(f, m) or f"{(f - m) / m * 100 if m else 0.0:+.1f} %"
        out.append(f"peak tensor memory {name}: {gib(m)} measured, {gib(f)} forecast ({err})")
    return out


class _NoMeter:
    """A run without a forecast: nothing measured."""

    def start(self, total_steps: int, first_step: int, log_every: int = 1) -> None:
        pass

    def step(self, n: int, backend: Any) -> contextlib.AbstractContextManager[None]:
        return _NOTHING


NO_METER = _NoMeter()


def run_meter(
    devices: list[Device], forecast: Forecast | None, place: tuple[Device, int, int] | None, weights: list[float] | None
) -> PeakMeter | None:
    """The run's peak meter: a single process's where the fit check made a forecast; a rank's (``place``: its
    device, rank and world) where its launcher made one (``rank_meter``). None: nothing measured."""
    if place is not None:
        return rank_meter(*place, weights)
    return PeakMeter(devices, forecast) if forecast is not None else None
