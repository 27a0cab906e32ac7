"""Exponential moving average of a growing column, in numpy alone.

(scipy.signal.lfilter does the same, but importing scipy.signal took 0.9 s, and the first smoothed
redraw of a session paid it in the GUI thread.)
"""

from __future__ import annotations

import math

import numpy as np


def ema_filter(x: np.ndarray, alpha: float, state: float) -> np.ndarray:
    """``y[i] = alpha * y[i-1] + (1 - alpha) * x[i]`` with ``y[-1] = state``, for finite ``x``.

    Closed form per block of ``m`` values: ``y[i] = a^(i+1) * (state + (1-a) * sum_{k<=i} x[k] / a^(k+1))``,
    vectorized with a cumulative sum. ``m`` keeps ``a^-m`` below 1e200, far from overflow.
    """
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    n = len(x)
    out = np.empty(n)
    m = int(min(1024, max(1, 200 // -math.log10(alpha))))
    powers = alpha ** np.arange(1, min(m, n) + 1)
    inverse = 1.0 / powers
    for s in range(0, n, m):
        block = x[s : s + m]
        k = len(block)
        y = (state + (1 - alpha) * np.cumsum(block * inverse[:k])) * powers[:k]
        out[s : s + k] = y
        state = y[-1]
    return out


def ema(y: np.ndarray, alpha: float) -> np.ndarray:
    """Exponential moving average over the full-resolution data (NaN gaps carried, not spread)."""
    return EmaCache(alpha).extend(y)


class EmaCache:
    """An EMA kept up to date incrementally as a column grows (each refresh filters new rows only)."""

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha
        self.out = np.empty(0)
        self.n = 0
        self.state = math.nan  # last output
        self.last = math.nan  # last finite input

    def extend(self, y: np.ndarray) -> np.ndarray:
        if self.alpha <= 0:
            return y
        new = y[self.n :]
        if len(new):
            finite = np.isfinite(new)
            idx = np.where(finite, np.arange(len(new)), -1)
            np.maximum.accumulate(idx, out=idx)
            filled = np.where(idx >= 0, new[np.maximum(idx, 0)], self.last)
            if math.isnan(self.state) and finite.any():
                self.state = new[finite][0]
                filled[np.isnan(filled)] = self.state
            if finite.any() or not math.isnan(self.state):
                out = ema_filter(filled, self.alpha, self.state)
                self.state = out[-1]
            else:
                out = np.full(len(new), math.nan)
            out[~finite] = math.nan
            if finite.any():
                self.last = new[finite][-1]
            grown = np.empty(self.n + len(new))
            grown[: self.n] = self.out[: self.n]
            grown[self.n :] = out
            self.out, self.n = grown, len(grown)
        return self.out[: len(y)]
