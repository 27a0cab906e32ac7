"""The gradient noise scale from the lanes: McCandlish et al. 2018 ("An Empirical Model of Large-Batch
Training", appendix A), from what a data-parallel step already holds — no extra backward.

The step's gradient is a weighted sum of per-unit gradients ``g_n`` (a unit is a sample, or with the
task's ``loss_weight`` one unit of that weight, e.g. a token): ``h = Σ_n a_n g_n``. Lane ``i`` adds
``h_i = Σ_{n ∈ lane i} a_n g_n`` (its shard's part, summed over the step's micro-batches) and
``h = Σ_i h_i``. With the ``g_n`` independent, of mean ``G`` and covariance ``Σ`` (``S = tr Σ``),
``A_i = Σ_{n ∈ i} a_n`` and ``Q_i = Σ_{n ∈ i} a_n²``:

    E|h_i|² = A_i²·|G|² + Q_i·S        E[h_i·h_j] = A_i·A_j·|G|²  (i ≠ j)

so the cross terms give ``|G|²`` and the lanes' own squares then give ``S``, both unbiased:

    |G|² ≈ (|h|² − Σ|h_i|²) / (A² − Σ A_i²)        S ≈ (Σ|h_i|² − Σ A_i²·|G|²) / Σ Q_i

With ``k`` even shares of a batch ``B`` (``a_n = 1/B``) these are exactly the paper's
``|G|² ≈ (B_big|G_big|² − B_small|G_small|²)/(B_big − B_small)`` and
``S ≈ (|G_small|² − |G_big|²)/(1/B_small − 1/B_big)`` with ``B_small = B/k`` and ``|G_small|²`` the
mean over the lanes; with uneven shares (``devices.weights``, a short last batch) each lane counts by
its own ``A_i`` and ``Q_i``, which keeps both estimates unbiased. Each is smoothed by its own
exponential moving average (bias-corrected), and ``B_simple = S / |G|²`` is the ratio of the averages.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class LaneShares:
    """Each lane's ``A_i`` and ``Q_i`` over one optimizer step (see the module docstring), and the
    step's units (samples, or the loss weight)."""

    a: list[float]
    q: list[float]
    units: float = 0.0

    @classmethod
    def empty(cls, lanes: int) -> LaneShares:
        return cls([0.0] * lanes, [0.0] * lanes)

    def add_micro(
        self, lane_units: Sequence[float], lanes: Sequence[int], accum: int, total: float | None = None
    ) -> None:
        """One micro-batch whose lanes ``lanes`` carried ``lane_units`` units each, every unit weighted
        ``1 / (N·accum)`` (the combined loss is the micro-batch's mean, divided by ``accum``); ``N`` is
        ``total``, by default the sum of ``lane_units`` (a ddp rank knows only its own lane's)."""
        total = float(sum(lane_units)) if total is None else float(total)
        if total <= 0:
            return
        a = 1.0 / (total * accum)
        for lane, n in zip(lanes, lane_units, strict=True):
            self.a[lane] += n * a
            self.q[lane] += n * a * a
            self.units += n


def step_estimate(lane_sq: Sequence[float], total_sq: float, shares: LaneShares) -> tuple[float, float] | None:
    """The unbiased ``(|G|², S)`` of one step from each lane's ``|h_i|²`` and the combined ``|h|²``;
    None when fewer than two lanes took part or a value is not finite."""
    used = [i for i, a in enumerate(shares.a) if a > 0]
    if len(used) < 2 or not math.isfinite(total_sq):
        return None
    if not all(math.isfinite(lane_sq[i]) and lane_sq[i] > 0 for i in used):
        return None  # a lane's gradient not caught (a ddp rank's first step reduces by hand)
    a_total = sum(shares.a[i] for i in used)
    a_sq = sum(shares.a[i] ** 2 for i in used)
    q = sum(shares.q[i] for i in used)
    own = sum(lane_sq[i] for i in used)
    den = a_total**2 - a_sq
    if den <= 0 or q <= 0:
        return None
    g2 = (total_sq - own) / den
    trace = (own - a_sq * g2) / q
    return g2, trace


class NoiseScale:
    """The smoothed estimates: an exponential moving average of ``|G|²`` and of ``S`` each, corrected
    for their start (as Adam's moments are), and their ratio ``B_simple``."""

    def __init__(self, decay: float = 0.9) -> None:
        self.decay = decay
        self.g2 = 0.0
        self.trace = 0.0
        self.weight = 0.0  # 1 - decay^n: the start correction
        self.samples = 0

    def add(self, g2: float, trace: float) -> None:
        d = self.decay
        self.g2 = d * self.g2 + (1 - d) * g2
        self.trace = d * self.trace + (1 - d) * trace
        self.weight = d * self.weight + (1 - d)
        self.samples += 1

    def value(self) -> dict[str, Any] | None:
        """``{"g2", "trace", "b_simple"}`` (``b_simple`` None while the smoothed ``|G|²`` is not > 0)."""
        if self.samples == 0:
            return None
        g2, trace = self.g2 / self.weight, self.trace / self.weight
        b = trace / g2 if g2 > 0 and trace >= 0 else None
        return {"g2": g2, "trace": trace, "b_simple": b}

    def state_dict(self) -> dict[str, Any]:
        return {"g2": self.g2, "trace": self.trace, "weight": self.weight, "samples": self.samples}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if isinstance(state, dict) and {"g2", "trace", "weight", "samples"} <= set(state):
            self.g2, self.trace = float(state["g2"]), float(state["trace"])
            self.weight, self.samples = float(state["weight"]), int(state["samples"])


def format_noise_scale(b_simple: float) -> str:
    """The noise scale as every view prints it: a batch size, whole ("1,481"; "0.4" below one)."""
    return f"{b_simple:,.0f}" if abs(b_simple) >= 1 else f"{b_simple:.1g}"


def verdict(batch: float, b_simple: float | None, unit: str = "samples") -> str:
    """One line for the window and the CLI: the batch against the noise scale."""
    if b_simple is None:
        return f"batch {batch:,.0f} · noise scale not yet known"
    if b_simple > 2 * batch:
        hint = "a larger batch, or more GPUs, would still help"
    elif b_simple < batch / 2:
        hint = "the batch is past the noise scale: a larger one would mostly waste compute"
    else:
        hint = "the batch is near the noise scale"
    per = "" if unit == "samples" else f" ({unit})"
    return f"batch {batch:,.0f}{per} · noise scale ≈ {format_noise_scale(b_simple)}: {hint}"
