"""Peak decimation for long, growing curves: what is drawn is at most a few points per pixel.

A curve of a million points keeps a pyramid of block minima and maxima (blocks of 32, 256, 2048 and
16384 samples), extended incrementally as the run appends. Drawing a view asks for the coarsest
level that still gives about one block per pixel, so a redraw touches thousands of numbers, not
millions, and every spike stays visible (a block draws as its minimum and its maximum). No Qt here.
"""

from __future__ import annotations

import numpy as np

BASE = 32
FACTOR = 8
LEVELS = 4


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


def _fold(values: np.ndarray, size: int, fn) -> np.ndarray:
    blocks = len(values) // size
    with np.errstate(invalid="ignore"):
        return fn.reduce(values[: blocks * size].reshape(blocks, size), axis=1)


class PeakPyramid:
    """Block minima/maxima of one append-only column, at sizes BASE * FACTOR**k."""

    def __init__(self) -> None:
        self.sizes = [BASE * FACTOR**k for k in range(LEVELS)]
        self.mins = [_Grow() for _ in self.sizes]
        self.maxs = [_Grow() for _ in self.sizes]

    def update(self, y: np.ndarray) -> None:
        """Bring the pyramid up to date with ``y`` (the whole column; only new blocks are computed)."""
        prev_min, prev_max = y, y
        for k, size in enumerate(self.sizes):
            step = BASE if k == 0 else FACTOR
            done = self.mins[k].n
            full = len(y) // size
            if full > done:
                lo, hi = done * step, full * step
                self.mins[k].extend(_fold(prev_min[lo:hi], step, np.fmin))
                self.maxs[k].extend(_fold(prev_max[lo:hi], step, np.fmax))
            prev_min, prev_max = self.mins[k].data, self.maxs[k].data

    def view(self, x: np.ndarray, y: np.ndarray, i0: int, i1: int, max_points: int) -> tuple[np.ndarray, np.ndarray]:
        """Points to draw for samples ``[i0, i1)``: raw where few, else min/max per block."""
        if i1 - i0 <= max_points:
            return x[i0:i1], y[i0:i1]
        level = 0
        while level + 1 < LEVELS and (i1 - i0) / self.sizes[level] > max_points / 2:
            level += 1
        xs, ys = [], []
        pos = i0
        # From the chosen level down to raw: each level covers what the coarser one cannot.
        for k in range(level, -1, -1):
            size = self.sizes[k]
            b0 = -(-pos // size)  # first whole block at or after pos
            if k == level:
                b0 = pos // size  # the first block may start a little before the view: fine
            b1 = min(self.mins[k].n, i1 // size)
            if b1 > b0:
                if b0 * size > pos:  # a gap before the first block: draw it from finer data below
                    gx, gy = self.view(x, y, pos, b0 * size, max_points)
                    xs.append(gx)
                    ys.append(gy)
                starts = np.arange(b0, b1) * size
                bx = np.repeat(x[starts], 2)
                by = np.column_stack((self.mins[k].data[b0:b1], self.maxs[k].data[b0:b1])).ravel()
                xs.append(bx)
                ys.append(by)
                pos = b1 * size
        if pos < i1:
            xs.append(x[pos:i1])
            ys.append(y[pos:i1])
        return np.concatenate(xs), np.concatenate(ys)
