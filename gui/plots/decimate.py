"""What a long, growing curve draws: its decimation and its smoothing.

Decimation: at most four real samples per pixel column, in time order.

What is drawn for a pixel column is its first sample, its minimum, its maximum and its last sample,
in the order they happened (the M4 scheme: a line through those points rasterizes like the line
through all of them). Every drawn point is a sample of the data at its own x; a block is never drawn
as "minimum then maximum" at the block's start, which turned noise into a regular sawtooth.

A curve of a million points keeps a pyramid of block minima and maxima with their positions (blocks
of 32, 256, 2048 and 16384 samples), extended incrementally as the run appends, so a view of a
million samples reduces a few thousand blocks, not a million numbers. Columns are then made of whole
blocks (a block is at most 1/16 of a column), so an extreme lands at most 1/16 of a pixel
from the column a per-sample reduction would give it. No Qt here.
"""

from __future__ import annotations

import math

import numpy as np

BASE = 32
FACTOR = 8
LEVELS = 4
RAW_PER_COLUMN = 4  # up to this many samples a column, the samples themselves are drawn


class _Grow:
    def __init__(self) -> None:
        self.buf = np.empty(256)
        self.n = 0

    def extend(self, values: np.ndarray) -> None:
        need = self.n + len(values)
        if need > len(self.buf):
            grown = np.empty(max(need, 2 * len(self.buf)))
            grown[: self.n] = self.buf[: self.n]
            self.buf = grown
        self.buf[self.n : need] = values
        self.n = need

    @property
    def data(self) -> np.ndarray:
        return self.buf[: self.n]


def _low(y: np.ndarray) -> np.ndarray:
    return np.where(np.isnan(y), np.inf, y)  # a missing value is never a block's minimum


def _high(y: np.ndarray) -> np.ndarray:
    return np.where(np.isnan(y), -np.inf, y)


def _fold(values: np.ndarray, where: np.ndarray, size: int, pick) -> tuple[np.ndarray, np.ndarray]:
    """Blocks of ``size``: each block's extreme and the sample position it came from."""
    blocks = len(values) // size
    v = values[: blocks * size].reshape(blocks, size)
    k = pick(v, axis=1)
    rows = np.arange(blocks)
    return v[rows, k], where[: blocks * size].reshape(blocks, size)[rows, k]


def _group_extremes(low, high, pos_low, pos_high, starts) -> tuple[np.ndarray, np.ndarray]:
    """Per group (``starts`` into the arrays): the position of its minimum and of its maximum
    (the first one where there are ties)."""
    sizes = np.diff(np.append(starts, len(low)))
    gid = np.repeat(np.arange(len(starts)), sizes)
    out = []
    for values, pos, ufunc in ((low, pos_low, np.minimum), (high, pos_high, np.maximum)):
        ext = ufunc.reduceat(values, starts)
        hit = np.flatnonzero(values == ext[gid])
        _, first = np.unique(gid[hit], return_index=True)
        out.append(pos[hit[first]])
    return out[0], out[1]


class PeakPyramid:
    """Block minima/maxima (with their positions) of one append-only column, at sizes BASE * FACTOR**k."""

    def __init__(self) -> None:
        self.sizes = [BASE * FACTOR**k for k in range(LEVELS)]
        self.mins = [_Grow() for _ in self.sizes]
        self.maxs = [_Grow() for _ in self.sizes]
        self.argmins = [_Grow() for _ in self.sizes]  # sample positions, exact as float64 up to 2**53
        self.argmaxs = [_Grow() for _ in self.sizes]

    def update(self, y: np.ndarray) -> None:
        """Bring the pyramid up to date with ``y`` (the whole column; only new blocks are computed)."""
        for k, size in enumerate(self.sizes):
            step = BASE if k == 0 else FACTOR
            done = self.mins[k].n
            full = len(y) // size
            if full <= done:
                continue
            lo, hi = done * step, full * step
            if k == 0:
                low, high = _low(y[lo:hi]), _high(y[lo:hi])
                where = np.arange(lo, hi, dtype=float)
                where_low = where_high = where
            else:
                low, high = self.mins[k - 1].data[lo:hi], self.maxs[k - 1].data[lo:hi]
                where_low, where_high = self.argmins[k - 1].data[lo:hi], self.argmaxs[k - 1].data[lo:hi]
            v, p = _fold(low, where_low, step, np.argmin)
            self.mins[k].extend(v)
            self.argmins[k].extend(p)
            v, p = _fold(high, where_high, step, np.argmax)
            self.maxs[k].extend(v)
            self.argmaxs[k].extend(p)

    def view(self, x: np.ndarray, y: np.ndarray, i0: int, i1: int, columns: int) -> tuple[np.ndarray, np.ndarray]:
        """Points to draw for samples ``[i0, i1)`` over ``columns`` pixel columns."""
        idx = self.indices(x, y, i0, i1, columns)
        return x[idx], y[idx]

    def indices(
        self, x: np.ndarray, y: np.ndarray, i0: int, i1: int, columns: float, span: tuple[float, float] | None = None
    ) -> np.ndarray:
        """The positions of the samples to draw for ``[i0, i1)`` over ``columns`` pixel columns:
        each column's first, minimum, maximum and last sample, sorted by position. With ``span`` (the
        view's x range, ``columns`` its width in pixels) the columns are the screen's own."""
        n = i1 - i0
        if n <= 0:
            return np.arange(0)
        edges = _column_edges(x, i0, i1, columns, span)
        columns = max(1, len(edges) - 1)
        if n <= RAW_PER_COLUMN * columns:
            return np.arange(i0, i1)
        per_column = n / columns
        level = -1
        while level + 1 < LEVELS and self.sizes[level + 1] * 16 <= per_column and self.mins[level + 1].n:
            level += 1
        if level < 0:
            return _raw_indices(y, edges)
        size = self.sizes[level]
        b0 = -(-i0 // size)
        b1 = min(self.mins[level].n, i1 // size)
        if b1 <= b0:
            return _raw_indices(y, edges)
        parts = []
        head, tail = b0 * size, b1 * size
        if head > i0:  # samples before the first whole block: from finer levels
            parts.append(
                self.indices(x, y, i0, head, columns if span else max(1, round((head - i0) / per_column)), span)
            )
        groups = np.unique(np.clip(np.round(edges / size).astype(np.int64), b0, b1))
        groups = groups[groups < b1]
        lo_pos, hi_pos = _group_extremes(
            self.mins[level].data[b0:b1],
            self.maxs[level].data[b0:b1],
            self.argmins[level].data[b0:b1],
            self.argmaxs[level].data[b0:b1],
            groups - b0,
        )
        ends = np.append(groups[1:], b1) * size - 1
        parts += [groups * size, lo_pos.astype(np.int64), hi_pos.astype(np.int64), ends]
        if tail < i1:
            parts.append(
                self.indices(x, y, tail, i1, columns if span else max(1, round((i1 - tail) / per_column)), span)
            )
        return np.unique(np.concatenate(parts))


def _raw_indices(y: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Each column's first, minimum, maximum and last sample, reduced from the samples themselves."""
    i0, i1 = int(edges[0]), int(edges[-1])
    starts = edges[:-1] - i0
    starts = starts[starts < i1 - i0]
    where = np.arange(i0, i1)
    lo_pos, hi_pos = _group_extremes(_low(y[i0:i1]), _high(y[i0:i1]), where, where, starts)
    ends = np.append(starts[1:], i1 - i0) + i0 - 1
    return np.unique(np.concatenate((starts + i0, lo_pos, hi_pos, ends)))


def _column_edges(
    x: np.ndarray, i0: int, i1: int, columns: float, span: tuple[float, float] | None = None
) -> np.ndarray:
    """Sample positions where each pixel column starts: the screen's columns where ``span`` is the
    view's x range over ``columns`` pixels, else ``columns`` equal widths in x (or in count)."""
    a, b = x[i0], x[i1 - 1]
    if not (np.isfinite(a) and np.isfinite(b) and b > a):
        inner = np.linspace(i0, i1, max(1, int(columns)) + 1)[1:-1].astype(np.int64)
        return np.unique(np.concatenate(([i0], inner, [i1])))
    if span is not None and span[1] > span[0]:
        width = (span[1] - span[0]) / max(1.0, columns)
        k0, k1 = np.floor((a - span[0]) / width) + 1, np.ceil((b - span[0]) / width)
        cuts = span[0] + width * np.arange(k0, k1) if k1 > k0 else np.empty(0)
    else:
        cuts = np.linspace(a, b, max(1, int(columns)) + 1)[1:-1]
    inner = i0 + np.searchsorted(x[i0:i1], cuts, side="left")
    return np.unique(np.concatenate(([i0], inner, [i1])))


# -- smoothing ------------------------------------------------------------------------------------
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
