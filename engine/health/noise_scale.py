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
its own ``A_i`` and ``Q_i``, which keeps both estimates unbiased. One step's estimates scatter widely
(a ratio of two noisy numbers): ``NoiseScale`` averages every measured step's, weighted by its batch,
and ``B_simple = S / |G|²`` is the ratio of the two averages, with a band from their standard errors.
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


def measured(step: int, every: int) -> bool:
    """Whether step ``step`` is one of the noise scale's measured steps: about one in ``every``, picked by
    a fixed hash of the step (murmur3's finalizer), not ``step % every``, so that no period of the run
    lines up with them — every 4th step of 4-step epochs would measure only their short last batches.
    The same on every rank and in every run."""
    if every <= 1:
        return True
    x = step & 0xFFFFFFFF
    x = ((x ^ (x >> 16)) * 0x85EBCA6B) & 0xFFFFFFFF
    x = ((x ^ (x >> 13)) * 0xC2B2AE35) & 0xFFFFFFFF
    return (x ^ (x >> 16)) % every == 0


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


Z = 1.96
"""The band's half-width in standard errors: a 95 % interval (Fieller's, below)."""

_SUMS = ("w", "wg", "wt", "q", "qg", "qt", "qgg", "qtt", "qgt", "n", "units")


class NoiseScale:
    """The run's estimate from every measured step: weighted means of the steps' ``|G|²`` and ``S``
    (each step weighted by its real batch, in units), ``B_simple`` their ratio, and a band.

    The weights decay by ``decay`` per measured step (an exponential window of ~``2 / (1 − decay)``
    steps, so a long run follows ``B_simple`` as it grows while the loss falls); the steps' estimates
    are independent (their batches are), so each mean's standard error is the weighted spread of the
    steps' estimates (``Σ e² (x − x̄)² / (Σ e)²``, a sandwich estimator that allows the short last batch of
    an epoch its larger scatter), with their covariance. The band is Fieller's interval for the ratio of
    the two means at ``Z`` standard errors: the exact propagation of both errors to a ratio, which is
    unbounded (None) while ``|G|²``'s mean is not clear of zero."""

    def __init__(self, decay: float = 0.99) -> None:
        self.decay = decay
        self.s = dict.fromkeys(_SUMS, 0.0)
        self.samples = 0

    def add(self, g2: float, trace: float, weight: float = 1.0) -> None:
        """One step's unbiased estimates, weighted by the step's units (its batch)."""
        if not (math.isfinite(g2) and math.isfinite(trace) and weight > 0):
            return
        s, d = self.s, self.decay
        for k in ("w", "wg", "wt", "n", "units"):
            s[k] *= d
        for k in ("q", "qg", "qt", "qgg", "qtt", "qgt"):
            s[k] *= d * d
        w, w2 = weight, weight * weight
        s["w"] += w
        s["wg"] += w * g2
        s["wt"] += w * trace
        s["q"] += w2
        s["qg"] += w2 * g2
        s["qt"] += w2 * trace
        s["qgg"] += w2 * g2 * g2
        s["qtt"] += w2 * trace * trace
        s["qgt"] += w2 * g2 * trace
        s["n"] += 1.0
        s["units"] += weight
        self.samples += 1

    def value(self) -> dict[str, Any] | None:
        """``{"g2", "trace", "b_simple", "lo", "hi", "steps", "batch"}``: the means, their ratio (None
        while ``|G|²``'s mean is not > 0), the band (None where it is unbounded or not yet known), the
        measured steps and the steps' mean batch in units."""
        if self.samples == 0:
            return None
        s = self.s
        g, t = s["wg"] / s["w"], s["wt"] / s["w"]
        b = t / g if g > 0 and t >= 0 else None
        lo, hi = self.band(g, t)
        return {
            "g2": g,
            "trace": t,
            "b_simple": b,
            "lo": lo,
            "hi": hi,
            "steps": self.samples,
            "batch": s["units"] / s["n"],
        }

    def band(self, g: float, t: float) -> tuple[float | None, float | None]:
        """Fieller's interval for ``t / g`` at ``Z`` standard errors, clipped at 0; ``(None, None)``
        with fewer than 3 steps or while ``g`` is not clear of zero."""
        s = self.s
        n_eff = s["w"] ** 2 / s["q"] if s["q"] > 0 else 0.0
        if self.samples < 3 or n_eff <= 1.5:
            return None, None
        w2 = s["w"] ** 2 * (1 - 1 / n_eff)  # the spread about the mean: one degree of freedom used
        vg = max(0.0, (s["qgg"] - 2 * g * s["qg"] + g * g * s["q"]) / w2)
        vt = max(0.0, (s["qtt"] - 2 * t * s["qt"] + t * t * s["q"]) / w2)
        c = (s["qgt"] - g * s["qt"] - t * s["qg"] + g * t * s["q"]) / w2
        z2 = Z * Z
        a = g * g - z2 * vg
        if g <= 0 or a <= 0:
            return None, None
        bq = -2 * (g * t - z2 * c)
        cq = t * t - z2 * vt
        disc = max(0.0, bq * bq - 4 * a * cq)
        lo, hi = (-bq - math.sqrt(disc)) / (2 * a), (-bq + math.sqrt(disc)) / (2 * a)
        return max(0.0, lo), max(0.0, hi)

    def state_dict(self) -> dict[str, Any]:
        return {"sums": dict(self.s), "samples": self.samples}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """A checkpoint's sums; one written before the band (no ``sums``) starts the estimate afresh."""
        if isinstance(state, dict) and isinstance(state.get("sums"), dict) and set(_SUMS) <= set(state["sums"]):
            self.s = {k: float(state["sums"][k]) for k in _SUMS}
            self.samples = int(state.get("samples", 0))


def format_noise_scale(b_simple: float) -> str:
    """The noise scale as every view prints it: a batch size, whole ("1,481"; "0.4" below one)."""
    return f"{b_simple:,.0f}" if abs(b_simple) >= 1 else f"{b_simple:.1g}"


def unit_word(unit: str | None) -> str:
    """The unit as printed beside a number: "samples", "tokens", or what the task counts."""
    return unit or "samples"


def batch_text(batch: float, unit: str | None = "samples") -> str:
    """The batch the noise scale is judged against, as every view prints it. It is the mean over the
    measured steps, so an epoch's short last batch makes it a fraction: "batch 63.6 samples on average",
    not a rounded "batch 64" or "batch 63" that no step had; a whole number stays one."""
    if abs(batch - round(batch)) < 0.05:
        return f"batch {round(batch):,} {unit_word(unit)}"
    return f"batch {batch:,.1f} {unit_word(unit)} on average"


def band_text(lo: float | None, hi: float | None) -> str:
    """The band as every view prints it: "95 % band 900–2,400", or "band unbounded"."""
    if lo is None or hi is None:
        return "band unbounded"
    return f"95 % band {format_noise_scale(lo)}–{format_noise_scale(hi)}"


def noise_text(noise: dict[str, Any]) -> str | None:
    """A train record's ``noise`` as ``watch`` and export print it: "noise scale ≈ 1,481 tokens (95 %
    band 1,203–1,902)"; a record written before the band, the value alone. None when not yet known."""
    b = noise.get("b_simple")
    if not isinstance(b, (int, float)):
        return None
    text = f"noise scale ≈ {format_noise_scale(b)}"
    if isinstance(noise.get("unit"), str):
        text += f" {unit_word(noise['unit'])}"
    if "lo" in noise or "hi" in noise:
        text += f" ({band_text(noise.get('lo'), noise.get('hi'))})"
    return text


def verdict(
    batch: float, b_simple: float | None, unit: str = "samples", lo: float | None = None, hi: float | None = None
) -> str:
    """One line for the window and the CLI: the batch against the noise scale and its band. A verdict
    only where the band is clear of the batch (or, holding it, lies within a factor of 2 of it: near);
    otherwise "not yet known"."""
    u = unit_word(unit)
    head = batch_text(batch, unit)
    if b_simple is None:
        return f"{head} · noise scale not yet known"
    value = f"{head} · noise scale ≈ {format_noise_scale(b_simple)} {u} ({band_text(lo, hi)})"
    if lo is None or hi is None:
        hint = "not yet known whether a larger batch would help (the band is unbounded)"
    elif lo > batch:
        hint = "a larger batch, or more GPUs, would still help"
    elif hi < batch:
        hint = "the batch is past the noise scale: a larger one would mostly waste compute"
    elif batch / 2 <= lo and hi <= 2 * batch:
        hint = "the batch is near the noise scale"
    else:
        hint = "not yet known whether a larger batch would help (the band holds the batch)"
    return f"{value}: {hint}"
