"""Numbers as people read them: one formatter for every place a loss or metric is printed (the CLI's
progress and summary, ``multilane watch``, the app's runs table and hover line)."""

from __future__ import annotations

import math

SMALL = 0.01  # below this, four decimals would print 0.0000 or one digit: scientific instead
LARGE = 1e6


def format_number(v: float | int | None, decimals: int = 4) -> str:
    """``v`` by its size: ``2.3026``, ``0.0123``, ``6.12e-07``, ``1.23e+08``; never ``0.0000`` for a
    value that is not zero. NaN and the infinities as ``nan``, ``inf``, ``-inf``; None as ``—``."""
    if v is None:
        return "—"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    v = float(v)
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if v == 0:
        return f"{0:.{decimals}f}"
    if abs(v) < SMALL or abs(v) >= LARGE:
        return f"{v:.{max(1, decimals - 2)}e}"
    return f"{v:.{decimals}f}"


def format_percent(v: float) -> str:
    """A share as a whole percent, never a "0%" that is not 0: 0.4 → "<1%", 41.6 → "42%", 0 → "0%"."""
    return "<1%" if 0 < v < 0.5 else f"{v:.0f}%"
