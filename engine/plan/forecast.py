"""The forecast: each memory's peak at the run's batch, against what that memory has free, and the
largest batch that fits. Plain data (``to_dict``/``from_dict``): the CLI prints it, ``plan --json``
hands it to the app, the run folder keeps it for the end-of-run comparison."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from multilane.engine.parallel.split import chunk_sizes

USABLE = 0.9
"""A run fits where its forecast peak is at most this share of the memory free: the rest is for the
CUDA caching allocator's rounding and fragmentation (its reserve is above what it hands out) and for
the forecast's own error (its goal: within 10 %)."""

MAX_BATCH = 1_000_000  # config's data.batch_size bound


@dataclass
class Need:
    name: str
    """``cuda:0``, or ``cpu`` (the RAM every CPU lane shares)."""
    need: int
    """Bytes at the step's peak (the forecast)."""
    free: int | None
    """Bytes free on that memory now (GPU: free device memory; CPU: available RAM), None if unknown."""
    ranks: int = 1
    """ddp and fsdp on CPU lanes: the processes whose needs add up in this memory (``need``)."""
    per_rank: int | None = None
    """With ``ranks`` > 1: the largest one process's need."""
    shards: list[int] | None = None
    """fsdp: [parameter + gradient + optimizer-state bytes a rank holds, one device's whole]."""

    @property
    def fits(self) -> bool:
        return self.free is None or self.need <= USABLE * self.free


@dataclass
class Forecast:
    batch: int
    n_devices: int
    strategy: str
    needs: list[Need]
    largest_batch: int | None
    """The largest global batch that fits on every memory (None: not even one sample per device)."""
    lines: list[dict[str, Any]] = field(default_factory=list)
    """Each memory's fitted line (``probe.MemoryLine`` as a dict): fixed, per_sample, optimizer bytes."""

    @property
    def fits(self) -> bool:
        return all(n.fits for n in self.needs)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Forecast:
        needs = [Need(**n) for n in d["needs"]]
        return cls(d["batch"], d["n_devices"], d["strategy"], needs, d.get("largest_batch"), d.get("lines", []))

    def refusal(self) -> str | None:
        """One line saying why the run will not fit, with the largest batch that would; None when it fits."""
        bad = [n for n in self.needs if not n.fits]
        if not bad:
            return None
        n = bad[0]
        where = "the CPU lanes need" if n.name == "cpu" else f"{n.name} needs"
        room = "of RAM is available" if n.name == "cpu" else "is free"
        head = (
            f"will not fit: {where} {gib(n.need)} at batch {self.batch:,} and {gib(n.free or 0)} {room} "
            f"(a run may use {USABLE:.0%} of it)"
        )
        if self.largest_batch is None:
            return f"{head}; it does not fit even with one sample per device"
        per = f" ({self.largest_batch // self.n_devices:,} per device)" if self.n_devices > 1 else ""
        return f"{head}; the largest batch that fits is {self.largest_batch:,}{per}: --batch-size {self.largest_batch}"

    def table(self) -> list[str]:
        """Lines for ``multilane plan``: each memory's need against its free memory."""
        out = [f"memory forecast for batch {self.batch:,} ({self.strategy}, {self.n_devices} device(s)):"]
        for n in self.needs:
            free = "unknown" if n.free is None else gib(n.free)
            what = "RAM available" if n.name == "cpu" else "free"
            verdict = "fits" if n.fits else "WILL NOT FIT"
            share = f" ({n.need / n.free:.0%})" if n.free else ""
            out.append(f"  {n.name:<8} needs {gib(n.need):>10} · {what} {free}{share} · {verdict}")
            if n.per_rank is not None:
                out.append(f"           {n.ranks} processes, each up to {gib(n.per_rank)}")
            if n.shards:
                out.append(
                    f"           shards per device {gib(n.shards[0])} (parameters, gradients, optimizer state; "
                    f"one device whole: {gib(n.shards[1])})"
                )
        if self.largest_batch is not None:
            out.append(f"  the largest batch that fits: {self.largest_batch:,}")
        return out


SMALL_PEAK = 1 << 20
"""Below this peak (forecast and measured both), the end-of-run comparison gives the difference in bytes,
not in percent: at KiB scale a step's fixed few allocations (the loss, a scalar per parameter, the
optimizer's step counters) are most of the peak, so "-87.5 %" would alarm about a few KiB."""


def small_difference(forecast: float, measured: float) -> str | None:
    """ "-26.0 KiB" where both peaks are under ``SMALL_PEAK``, else None (the caller gives a percent)."""
    if max(forecast, measured) >= SMALL_PEAK:
        return None
    d = forecast - measured
    return f"{'-' if d < 0 else '+'}{gib(abs(d))}"


def gib(nbytes: float) -> str:
    """Bytes as the memory column shows them: bytes, KiB, MiB below 1 GiB, GiB with two decimals above
    (a tiny model's need reads as what it is, never "0.0 MiB")."""
    if nbytes < 1 << 10:
        return f"{nbytes:,.0f} B"
    if nbytes < 1 << 20:
        return f"{nbytes / (1 << 10):,.1f} KiB"
    if nbytes < 1 << 30:
        return f"{nbytes / (1 << 20):,.1f} MiB"
    return f"{nbytes / (1 << 30):,.2f} GiB"


def per_rank_at(line: Any, batch: int, n: int, weights: list[float] | None) -> int:
    """The largest one process's need on a line of several (``ranks``) at global ``batch``."""
    shares = chunk_sizes(batch, n, weights or None)
    return max(line.need(shares[i]) for i in line.lanes)


def needs_at(lines: list[Any], batch: int, n: int, weights: list[float] | None) -> list[int]:
    """Each memory line's need at global ``batch`` (a ddp run on CPU lanes: its ranks' needs added)."""
    shares = chunk_sizes(batch, n, weights or None)
    out = []
    for line in lines:
        if line.ranks > 1:
            out.append(sum(line.need(shares[i]) for i in line.lanes))
        else:
            out.append(line.need(sum(shares[i] for i in line.lanes)))
    return out


def largest_batch(fits: Callable[[int], bool], n: int) -> int | None:
    """The largest global batch ``b`` (from ``n``: one sample per device) with ``fits(b)``; fits is monotone."""
    if not fits(n):
        return None
    lo, hi = n, n
    while hi < MAX_BATCH and fits(hi):
        lo, hi = hi, min(MAX_BATCH, hi * 2)
    if fits(hi):
        return hi
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
