"""The plot panel's axis ranges: one x range shared by every plot, following the data in steps until
the user zooms or pans; y axes from zero with headroom where a wobble must not look like a cliff."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from multilane.gui.plots.run_view import X_LABELS, x_values
from multilane.gui.runs.run_data import RunData, Series


class SharedXRange:
    """Mixed into ``PlotPanel``: reads its ``plots``, ``loss``, ``util``, ``zero_based``, ``data`` and
    ``overlays``, and keeps ``auto_x``, ``_x_span``, ``_tops`` and ``_syncing``."""

    def _sync_x(self, source, x_range) -> None:
        """Copy one plot's x range to all; a range the user made (zoom, pan) ends auto x."""
        if self._syncing:
            return
        span = self._x_span
        if span is not None and self.auto_x:
            tol = 1e-6 * max(span[1] - span[0], 1e-12)
            if abs(x_range[0] - span[0]) > tol or abs(x_range[1] - span[1]) > tol:
                self.auto_x = False
                self.sigAutoXLost.emit()
        self._dirty = True  # decimate for the new view at the next refresh
        self._syncing = True
        try:
            for p in self.plots:
                if p.vb is not source:
                    p.setXRange(*x_range, padding=0)
        finally:
            self._syncing = False

    def set_log_y(self, on: bool) -> None:
        """A log loss axis; the x range and auto range stay as they were."""
        x_range = self.loss.vb.viewRange()[0]
        self._syncing = True  # the switch moves the view: not the user's zoom
        try:
            self.loss.setLogMode(y=on)
            if self.auto_x:
                self.loss.enableAutoRange(axis="y")
            for p in self.plots:
                p.setXRange(*x_range, padding=0)
        finally:
            self._syncing = False
        self._dirty = True

    def set_auto_range(self, on: bool) -> None:
        self.auto_x = on
        self._x_span = None
        for p in self.plots:
            if on and p is not self.util and p not in self.zero_based:
                p.enableAutoRange(axis="y")
            elif not on:
                p.disableAutoRange()
        self.util.setYRange(0, 100, padding=0.02)  # a percentage: a fixed axis, never repainted for it
        self._tops.clear()
        self._dirty = True
        self.refresh()

    def fit_x(self) -> None:
        """The x range exactly around the data (a finished run has no more to grow into)."""
        if not self.auto_x:
            return
        ends = self._x_ends()
        if ends:
            lo, hi = ends
            pad = 0.01 * max(hi - lo, 1e-9)
            self._set_span((lo - pad, hi + pad))

    def _x_ends(self) -> tuple[float, float] | None:
        d = self.data
        ends = [(self._x(d, s)[0], self._x(d, s)[-1]) for s in (d.train, d.eval, d.telemetry) if s.rows]
        ends += [(self._x(r, r.train)[0], self._x(r, r.train)[-1]) for r, _ in self.overlays if r.train.rows]
        ends = [(a, b) for a, b in ends if np.isfinite(a) and np.isfinite(b)]
        if not ends:
            return None
        return min(a for a, _ in ends), max(b for _, b in ends)

    def _set_span(self, new: tuple[float, float]) -> None:
        new = (max(0.0, new[0]), max(new[1], max(0.0, new[0]) + 1e-9))  # the views' limit: nothing below 0
        self._x_span = new
        self._syncing = True
        try:
            for p in self.plots:
                p.setXRange(*new, padding=0)
        finally:
            self._syncing = False

    def _follow_x(self, lo: float, hi: float) -> None:
        """Keep all data in view, growing the range by a quarter when the data reaches its end."""
        span = self._x_span
        if span is not None and span[0] <= lo and hi <= span[1] and (hi - lo) > 0.5 * (span[1] - span[0]):
            return
        width = max(hi - lo, 1e-9)
        self._set_span((lo, hi + 0.25 * width if span is not None else hi + 0.05 * width))

    def _set_x_label(self) -> None:
        self.phases.setLabel("bottom", X_LABELS[self.x_mode])

    def _x(self, data: RunData, series: Series) -> np.ndarray:
        return x_values(data, series, self.x_mode)

    def _from_zero(self, plot: pg.PlotItem, columns: list[np.ndarray]) -> None:
        """A y axis from zero with headroom, changed only when the data outgrows it (or shrinks a lot):
        autoscaled, a flat 0.2 MiB wobble in memory looked like a cliff and a constant lr a wall."""
        if not self.auto_x:
            return
        tops = [np.nanmax(c) for c in columns if len(c) and np.isfinite(c).any()]
        top = max(tops, default=0.0)
        shown = self._tops.get(id(plot), 0.0)
        if top > 0 and not (0.5 * shown <= top <= shown / 1.05):
            self._tops[id(plot)] = top * 1.25
            plot.setYRange(0, top * 1.25, padding=0)
