"""The few layers that need attention, and why: read from a run's sampled health records (and where a NaN
began), for the Health view's list and ``multilane watch``. Rules of thumb, each named in its line:

- dead units: 90 % or more of a layer's activations are exact zeros;
- the update-to-weight ratio far from its usual ~1e-3: above 1e-1 (the step rewrites the layer) or below
  1e-6 (the layer barely moves);
- a gradient norm exploding or vanishing against the layer's own history (three earlier samples at least):
  exploding at 10 times the median of its earlier samples or more; vanishing at a tenth or less of what the
  other layers kept of theirs (gradients shrink everywhere as the loss falls: only a layer that shrinks
  far more than the rest is named); or exactly zero (the layer received no gradient);
- the NaN origin, first, where the run has one.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

DEAD_ZEROS = 0.9
RATIO_HIGH, RATIO_LOW = 1e-1, 1e-6
EXPLODE, VANISH = 10.0, 0.1
HISTORY = 3


@dataclass(frozen=True)
class Finding:
    """One line of the diagnosis: the layer (a row of the heatmap), the quantity that shows it, and why."""

    row: str | None
    quantity: str
    text: str


def _series(records: list[dict[str, Any]], quantity: str, rows_key: str) -> dict[str, list[float]]:
    """Each row's finite values of ``quantity`` over the sampled records, in step order."""
    out: dict[str, list[float]] = {}
    for r in records:
        for name, v in zip(r.get(rows_key) or [], r.get(quantity) or [], strict=False):
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                out.setdefault(str(name), []).append(float(v))
    return out


def diagnose(records: list[dict[str, Any]], nan_origin: dict[str, Any] | None = None) -> list[Finding]:
    """The findings of a run's ``health`` records (oldest first) and its ``nonfinite_origin`` event."""
    found: list[Finding] = []
    if nan_origin is not None and isinstance(nan_origin.get("message"), str):
        layer = nan_origin.get("layer")  # the layer whose updates blew up first, where one did
        where = layer or nan_origin.get("where")
        quantity = "update_ratio" if layer else "grad_norm"
        found.append(Finding(str(where) if where else None, quantity, nan_origin["message"]))
    for name, zeros in _series(records, "act_zero", "act_rows").items():
        if zeros[-1] >= DEAD_ZEROS:
            found.append(
                Finding(name, "act_zero", f"{name}: {zeros[-1]:.0%} of its outputs are exact zeros (dead units)")
            )
    for name, ratios in _series(records, "update_ratio", "rows").items():
        r = ratios[-1]
        if r > RATIO_HIGH:
            text = f"{name}: update/weight {r:.1e}, far above the usual ~1e-3 (each step rewrites the layer)"
        elif 0 < r < RATIO_LOW:
            text = f"{name}: update/weight {r:.1e}, far below the usual ~1e-3 (the layer barely moves)"
        else:
            continue
        found.append(Finding(name, "update_ratio", text))
    norms_of = _series(records, "grad_norm", "rows")
    kept = {n: v[-1] / statistics.median(v[:-1]) for n, v in norms_of.items() if len(v) > HISTORY and v[-1] > 0}
    kept = {n: k for n, k in kept.items() if math.isfinite(k)}
    typical = statistics.median(kept.values()) if kept else 1.0
    for name, norms in norms_of.items():
        last = norms[-1]
        if last == 0:
            found.append(Finding(name, "grad_norm", f"{name}: gradient norm 0 (the layer received no gradient)"))
            continue
        if name not in kept:
            continue
        usual = last / kept[name]
        if kept[name] >= EXPLODE:
            text = f"{name}: gradient norm {last:.2e}, {kept[name]:.0f}× its usual {usual:.2e} (exploding)"
        elif kept[name] <= VANISH * typical:
            text = (
                f"{name}: gradient norm {last:.2e}, 1/{1 / kept[name]:.0f} of its usual {usual:.2e} while the "
                f"other layers kept {typical:.0%} of theirs (vanishing)"
            )
        else:
            continue
        found.append(Finding(name, "grad_norm", text))
    return found
