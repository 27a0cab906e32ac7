"""The plot panel's curves: each one peak-decimated to a few points per pixel of what is in view
(``PeakPyramid``, extended incrementally), EMA smoothing on the full data with the raw data faint
behind it, and the step time's stacked phases."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from multilane.gui.plots.decimate import EmaCache, PeakPyramid
from multilane.gui.plots.items import make_curve, set_plot_title
from multilane.gui.plots.palette import GAP, NEUTRAL, compared_width, device_width, run_dash, series_color
from multilane.gui.plots.run_view import (
    THROUGHPUT_TITLES,
    broken,
    compare_devices,
    compared_lines,
    gap_breaks,
    step_total,
)
from multilane.gui.plots.style import PHASE_COLORS, PHASES
from multilane.gui.runs.run_data import RunData, Series, recorded
from PySide6.QtCore import Qt


class CurveDrawing:
    """Mixed into ``PlotPanel`` (its ``metric_plot``: an attribute named ``metric`` shadowed QWidget.metric(), and grabbing the widget crashed): keeps ``_curves``, ``_raw``, ``_pyramids``, ``_ema``, ``_stack`` and
    ``_stack_tops``; reads ``smoothing``, ``auto_x``, ``loss`` and ``phases``."""

    def _item(self, key: str, plot: pg.PlotItem, color: str, name: str, **kw) -> pg.PlotDataItem:
        item = self._curves.get(key)
        if item is None:
            item = self._curves[key] = make_curve(plot, color, name, **kw)
        else:  # a device list that came after a record, one more run compared: the pen it should have now
            match_pen(item, color, kw.get("width"))
        return item

    def _show(
        self, key: str, item: pg.PlotDataItem, x: np.ndarray, y: np.ndarray, breaks: np.ndarray | None = None
    ) -> None:
        """Set a curve's data: at most four real samples per pixel column of what is in view, in time
        order (``decimate``), the line broken at ``breaks`` (row positions after a gap, pause or stop);
        a curve with a single point gets a marker, or it would not be drawn at all."""
        n = len(y)
        pyramid = self._pyramids.get(key)
        if pyramid is None or pyramid[1] > n:  # a new curve, or its data was cut (resume, reset)
            pyramid = (PeakPyramid(), 0)
        pyramid[0].update(y)
        self._pyramids[key] = (pyramid[0], n)
        i0, i1 = 0, n
        lo, hi = self.loss.vb.viewRange()[0]
        if not self.auto_x and n:
            # zoomed in: only what is in view (autorange needs all of it to see the data grow)
            i0 = max(0, int(np.searchsorted(x, lo)) - 1)
            i1 = min(n, int(np.searchsorted(x, hi)) + 1)
        vb = item.getViewBox()
        width = max(100.0, vb.width() if vb is not None else 1000.0)
        # the screen's own pixel columns: each one's extremes are drawn where they are
        idx = pyramid[0].indices(x, y, i0, i1, width, (lo, hi) if hi > lo else None)
        breaks = breaks if breaks is not None else np.empty(0, dtype=np.int64)
        if len(breaks):
            # each side of a break drawn to its end: the last step logged before a stop (or pause) and
            # the first after it, which a pixel column's extremes alone can leave out
            ends = np.concatenate([breaks - 1, breaks])
            idx = np.union1d(idx, ends[(ends >= i0) & (ends < i1)])
        vx, vy = broken(x, y, idx, breaks)
        if getattr(item, "keep_symbol", False):
            item.setData(vx, vy)
            return
        # A point with no drawn neighbour (a curve's only point, or one step logged between a stop and
        # the next) is a line of one point, which draws nothing: it gets a marker, the others none.
        finite = np.isfinite(vy)
        alone = finite.copy()
        alone[1:] &= ~finite[:-1]
        alone[:-1] &= ~finite[1:]
        if alone.any():
            pen = item.opts["pen"]
            sizes = np.where(alone, 6.0, 0.0)
            item.setData(vx, vy, symbol="o", symbolSize=sizes, symbolPen=pen, symbolBrush=pen.color())
            return
        if item.opts["symbol"] is not None:
            item.setSymbol(None)
        item.setData(vx, vy)

    def _breaks(self, run: RunData, series: Series, keep: np.ndarray | None = None) -> np.ndarray:
        """Where ``series``' lines break (``run_view.gap_breaks``), once per refresh and series; ``keep``
        selects the rows a curve draws (a telemetry column's recorded points)."""
        cache_key = (id(run), id(series), series.rows, len(run.events), None if keep is None else int(keep.sum()))
        hit = self._break_cache.get(cache_key)
        if hit is None or keep is not None:
            wall = series.get("wall_time")
            hit = gap_breaks(run, wall if keep is None else wall[keep], by_interval=series is not run.eval)
            self._break_cache[cache_key] = hit
        return hit

    def _show_finite(
        self, key: str, item: pg.PlotDataItem, x: np.ndarray, y: np.ndarray, run=None, series=None
    ) -> None:
        """A telemetry curve from its recorded points only (``run_data.recorded``)."""
        keep = np.isfinite(y)
        breaks = self._breaks(run or self.data, series or self.data.telemetry, None if keep.all() else keep)
        x, y = recorded(x, y)
        self._show(key, item, x, y, breaks)

    def _smooth(self, key: str, y: np.ndarray) -> np.ndarray:
        cache = self._ema.get(key)
        if cache is None or cache.alpha != self.smoothing or cache.n > len(y):
            cache = self._ema[key] = EmaCache(self.smoothing)
        return cache.extend(y)

    def _smoothed(self, key: str, plot: pg.PlotItem, color: str, name: str, x, y, width=1.5, breaks=None) -> None:
        """A curve with EMA smoothing (on the full data), the raw data faint behind it."""
        raw = self._raw.get(key)
        if self.smoothing > 0:
            if raw is None:
                raw = self._raw[key] = make_curve(plot, color, None, width=1, alpha=60)
                raw.setZValue(-1)
            else:
                match_pen(raw, color)
            self._show(f"raw|{key}", raw, x, y, breaks)
            y = self._smooth(key, y)
            data_key = f"ema|{key}|{self.smoothing}"  # a decimation pyramid of its own
        else:
            data_key = key
        self._show(data_key, self._item(key, plot, color, name, width=width), x, y, breaks)

    def _draw_stack(self, x: np.ndarray, tr: Series, breaks: np.ndarray | None = None) -> None:
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
            self._show(f"stack{k}", item, x, top, breaks)

    # -- comparing runs --------------------------------------------------------------------------
    def _draw_comparison(self) -> None:
        """Every run in its own colour in every panel: train loss solid and validation dashed, each
        metric, throughput, learning rate, gradient norm, step time, mean utilization, memory. Runs with
        equal values hide none of each other: the first run's line is the widest, each later one drawn
        over it narrower (``palette.device_width``), so every run's colour shows along an equal line."""
        runs = [self.data, *(r for r, _ in self.overlays)]
        n = len(runs)
        # tokens/s when every compared run logs them (language models), else samples/s for all
        speed = "tokens_per_s" if all(r.throughput_key == "tokens_per_s" for r in runs) else "samples_per_s"
        if self.throughput.titleLabel.text != THROUGHPUT_TITLES[speed]:
            set_plot_title(self.throughput, THROUGHPUT_TITLES[speed])
        for k, run in enumerate(runs):
            color = series_color(k)
            wide, thin = device_width(k, n, 2.0, 1.5), device_width(k, n, 1.5, 1.5)

            def curve(key, plot, name, width=thin, k=k, color=color, **kw) -> pg.PlotDataItem:
                item = self._item(f"cmp{k}:{key}", plot, color, name, width=width, **kw)
                item.setZValue(k)
                return item

            tr, ev = run.train, run.eval
            if tr.rows:
                x, br = self._x(run, tr), self._breaks(run, tr)
                if "loss" in tr.columns:
                    self._smoothed(f"cmp{k}:loss", self.loss, color, run.name, x, tr.get("loss"), wide, br)
                    self._curves[f"cmp{k}:loss"].setZValue(k)
                for col, plot in ((speed, self.throughput), ("lr", self.lr), ("grad_norm", self.grad_norm)):
                    if col in tr.columns:
                        self._show(f"cmp{k}:{col}", curve(col, plot, run.name), x, tr.get(col), br)
                total = step_total(tr)
                if np.isfinite(total).any():
                    self._show(f"cmp{k}:step", curve("step", self.phases, run.name), x, total, br)
            if ev.rows:
                x, br = self._x(run, ev), self._breaks(run, ev)
                val = curve("val", self.loss, f"{run.name} (validation)", wide, style=Qt.DashLine)
                self._show(f"cmp{k}:val", val, x, ev.get("val_loss"), br)
                for i, m in enumerate(run.metric_names):
                    style = Qt.SolidLine if i == 0 else Qt.DotLine
                    item = curve(f"metric/{m}", self.metric_plot, f"{run.name} {m}", wide, style=style)
                    self._show(f"cmp{k}:metric/{m}", item, x, ev.get(f"metric/{m}"), br)
        self._from_zero(self.lr, [r.train.get("lr") for r in runs if r.train.rows])  # every run's values
        self._draw_compared_devices(runs)

    def _draw_compared_devices(self, runs: list[RunData]) -> list[tuple[str, pg.PlotDataItem]]:
        """Utilization and memory when runs are compared: one line per device per run, in the device's
        colour (its place in ``compare_devices``: a device has one colour in every run), each run in its
        own line style (``palette.run_dash``). Equal lines hide nothing: the first run's lines are the
        widest and each later line is drawn over the earlier ones narrower, a dashed run's gaps painted
        white (``GAP``), so a run equal to another shows its dashes inside the other's line, which shows
        at their edges. Returns (key, item) of every line drawn, for the tests."""
        devices = compare_devices(runs)
        plan = []
        for k, run in enumerate(runs):
            if not run.telemetry.rows:
                continue
            lines = compared_lines(run, devices)
            for panel, plot in (("util", self.util), ("memory", self.memory)):
                plan += [(k, run, plot, col, dev) for col, dev in lines[panel]]
        drawn = []
        n = len(runs)
        for plot in (self.util, self.memory):
            mine = [p for p in plan if p[2] is plot]
            m = max((sum(1 for p in mine if p[0] == k) for k in range(n)), default=1)
            for i, (k, run, _plot, col, dev) in enumerate(mine):
                te = run.telemetry
                y = te.get(col)
                if not np.isfinite(y).any():
                    continue
                x = self._x(run, te)
                color = NEUTRAL if dev is None else series_color(devices.index(dev))
                j = sum(1 for p in mine[:i] if p[0] == k)  # its place among its run's lines
                width = compared_width(k, n, j, m, 1.5, 1.0, 2.0)
                name = f"{run.name} {dev or 'process'}"
                dash = run_dash(k)
                if dash is not None:  # white under the dashes: they show over an equal earlier line
                    gap = self._item(f"cmp{k}:{col}|gap", plot, GAP, None, width=width)
                    gap.setZValue(2 * i)
                    self._show_finite(f"cmp{k}:{col}|gap", gap, x, y, run, te)
                    drawn.append((f"cmp{k}:{col}|gap", gap))
                item = self._item(f"cmp{k}:{col}", plot, color, name, width=width, dash=dash)
                item.setZValue(2 * i + 1)
                self._show_finite(f"cmp{k}:{col}", item, x, y, run, te)
                drawn.append((f"cmp{k}:{col}", item))
        # the memory axis from zero holds every run's lines, not the shown run's alone
        self._from_zero(self.memory, [run.telemetry.get(col) for _k, run, plot, col, _d in plan if plot is self.memory])
        return drawn

    # -- what the key shows ----------------------------------------------------------------------
    def _apply_visibility(self) -> None:
        """Show a curve unless its key entry is clicked off; comparing runs, only the runs' curves."""
        comparing = bool(self.overlays)
        for store in (self._curves, self._raw):
            for key, item in store.items():
                visible = key.startswith("cmp") == comparing and group_of(key) not in self._hidden
                if store is self._raw:
                    visible = visible and self.smoothing > 0
                if item.isVisible() != visible:
                    item.setVisible(visible)
        for item in self._stack:
            if item.isVisible() == comparing:
                item.setVisible(not comparing)


def match_pen(item: pg.PlotDataItem, color: str, width: float | None = None) -> None:
    """Give ``item`` (and its point marker) ``color`` and ``width`` (None: as it is), its alpha and style
    kept; nothing is redrawn when it has them."""
    pen = item.opts["pen"]
    want = pg.mkColor(color)
    want.setAlpha(pen.color().alpha())
    if pen.color().rgba() == want.rgba() and (width is None or pen.widthF() == width):
        return
    pen = pg.mkPen(pen)
    pen.setColor(want)
    if width is not None:
        pen.setWidthF(width)
    item.setPen(pen)
    if item.opts["symbol"] is not None:
        item.setSymbolPen(pen)
        item.setSymbolBrush(want)


def group_of(key: str) -> str:
    """The key entry a curve belongs to: "dev:cpu:0", "combined", "validation" or "run:1"."""
    if key.startswith("cmp"):
        return f"run:{key[3 : key.index(':')]}"
    head, _, dev = key.partition("/")
    if key == "loss":
        return "combined"
    if key == "val":
        return "validation"
    if dev and head in ("loss", "util", "mem", "alloc", "power", "temp", "rss"):
        return f"dev:{dev}"
    return key
