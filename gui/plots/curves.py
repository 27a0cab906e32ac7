"""The plot panel's curves: each one peak-decimated to a few points per pixel of what is in view
(``PeakPyramid``, extended incrementally), EMA smoothing on the full data with the raw data faint
behind it, and the step time's stacked phases."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from multilane.gui.plots.decimate import PeakPyramid
from multilane.gui.plots.items import make_curve
from multilane.gui.plots.smoothing import EmaCache
from multilane.gui.plots.style import PHASE_COLORS, PHASES
from multilane.gui.runs.run_data import Series, recorded


class CurveDrawing:
    """Mixed into ``PlotPanel``: keeps ``_curves``, ``_raw``, ``_pyramids``, ``_ema``, ``_stack`` and
    ``_stack_tops``; reads ``smoothing``, ``auto_x``, ``loss`` and ``phases``."""

    def _item(self, key: str, plot: pg.PlotItem, color: str, name: str, **kw) -> pg.PlotDataItem:
        item = self._curves.get(key)
        if item is None:
            item = self._curves[key] = make_curve(plot, color, name, **kw)
        return item

    def _show(self, key: str, item: pg.PlotDataItem, x: np.ndarray, y: np.ndarray) -> None:
        """Set a curve's data, decimated to a few points per pixel of what is in view."""
        n = len(y)
        pyramid = self._pyramids.get(key)
        if pyramid is None or pyramid[1] > n:  # a new curve, or its data was cut (resume, reset)
            pyramid = (PeakPyramid(), 0)
        pyramid[0].update(y)
        self._pyramids[key] = (pyramid[0], n)
        i0, i1 = 0, n
        if not self.auto_x and n:
            # zoomed in: only what is in view (autorange needs all of it to see the data grow)
            lo, hi = self.loss.vb.viewRange()[0]
            i0 = max(0, int(np.searchsorted(x, lo)) - 1)
            i1 = min(n, int(np.searchsorted(x, hi)) + 1)
        width = max(200, int(item.getViewBox().width()) if item.getViewBox() is not None else 1000)
        vx, vy = pyramid[0].view(x, y, i0, i1, 2 * width)
        item.setData(vx, vy)

    def _show_finite(self, key: str, item: pg.PlotDataItem, x: np.ndarray, y: np.ndarray) -> None:
        """A telemetry curve from its recorded points only (``run_data.recorded``); one point alone
        gets a marker."""
        x, y = recorded(x, y)
        if (len(y) == 1) != (item.opts["symbol"] is not None):
            item.setSymbol("o" if len(y) == 1 else None)
            item.setSymbolSize(6)
            item.setSymbolPen(item.opts["pen"])
            item.setSymbolBrush(item.opts["pen"].color())
        self._show(key, item, x, y)

    def _smooth(self, key: str, y: np.ndarray) -> np.ndarray:
        cache = self._ema.get(key)
        if cache is None or cache.alpha != self.smoothing or cache.n > len(y):
            cache = self._ema[key] = EmaCache(self.smoothing)
        return cache.extend(y)

    def _smoothed(self, key: str, plot: pg.PlotItem, color: str, name: str, x, y, width=1.5) -> None:
        """A curve with EMA smoothing (on the full data), the raw data faint behind it."""
        raw = self._raw.get(key)
        if self.smoothing > 0:
            if raw is None:
                raw = self._raw[key] = make_curve(plot, color, None, width=1, alpha=60)
                raw.setZValue(-1)
            self._show(f"raw|{key}", raw, x, y)
            raw.setVisible(True)
            y = self._smooth(key, y)
            data_key = f"ema|{key}|{self.smoothing}"  # a decimation pyramid of its own
        else:
            data_key = key
            if raw is not None:
                raw.setVisible(False)
        self._show(data_key, self._item(key, plot, color, name, width=width), x, y)

    def _draw_stack(self, x: np.ndarray, tr: Series) -> None:
        present = [p for p in PHASES if f"phase/{p}" in tr.columns]
        if not present:
            return
        if not self._stack:
            # drawn top (the total) first, so each lower band paints over the one above it
            for p, color in reversed(list(zip(PHASES, PHASE_COLORS, strict=True))):
                if p not in present:
                    continue
                c = pg.mkColor(color)
                item = self.phases.plot([], [], pen=pg.mkPen(c, width=1), fillLevel=0, brush=pg.mkBrush(c), name=p)
                self._stack.append(item)
        # running totals, extended for new rows only
        n = tr.rows
        if self._stack_tops is None or self._stack_tops.shape[1] > n:
            self._stack_tops, done = np.zeros((len(present), 0)), 0
        else:
            done = self._stack_tops.shape[1]
        if n > done:
            new = np.cumsum([np.nan_to_num(tr.get(f"phase/{p}")[done:n]) for p in present], axis=0)
            self._stack_tops = np.concatenate([self._stack_tops, new], axis=1)
        for k, (item, top) in enumerate(zip(self._stack, self._stack_tops[::-1], strict=True)):
            self._show(f"stack{k}", item, x, top)
