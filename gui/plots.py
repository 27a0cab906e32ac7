"""The live plots: loss per device, combined and validation; metric; throughput; utilization; memory;
the step time split. All share one x axis (step or wall time) and one crosshair.

Data stays in numpy columns (``RunData``); a QTimer calls ``refresh()`` at 10–20 Hz, and nothing is
redrawn when no data came. Each curve is peak-decimated to a few points per pixel of what is in view
(``decimate.PeakPyramid``, extended incrementally), so a run of a million steps stays smooth and its
spikes stay visible; smoothing (EMA) runs on the full data, also incrementally.
"""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from multilane.gui.decimate import PeakPyramid
from multilane.gui.run_data import RunData, Series
from multilane.gui.smoothing import EmaCache
from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QAction, QFont

PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf"]
PHASES = ["data", "scatter", "replicate", "forward", "loss", "backward", "reduce", "optimizer"]
PHASE_COLORS = ["#7f7f7f", "#bcbd22", "#ff9896", "#1f77b4", "#9467bd", "#ff7f0e", "#8c564b", "#2ca02c"]

GRID_COLOR = "#e8e8e8"

pg.setConfigOptions(antialias=False, background="w", foreground="#333")
_TICK_FONT = QFont()
_TICK_FONT.setPointSize(8)


def _curve(
    plot: pg.PlotItem, color: str, name: str | None = None, width: float = 1.5, style=Qt.SolidLine, alpha: int = 255
) -> pg.PlotDataItem:
    c = pg.mkColor(color)
    c.setAlpha(alpha)
    # Width-1 pens for dense curves: wider lines cost Qt's raster engine twice the time.
    item = plot.plot([], [], pen=pg.mkPen(c, width=width, style=style), name=name, connect="finite")
    return item


class PlotPanel(pg.GraphicsLayoutWidget):
    """Every live plot of one run (plus overlaid past runs, for comparison)."""

    sigAutoXLost = Signal()  # the user zoomed or panned: the x range no longer follows the data
    sigExportRequested = Signal(str)  # "plots" or "bundle", from the plots' own right-click menu

    def __init__(self, parent=None) -> None:
        super().__init__(parent)
        self.data = RunData()
        self.overlays: list[tuple[RunData, list[pg.PlotDataItem]]] = []
        self.x_mode = "step"  # or "time"
        self.smoothing = 0.0  # EMA alpha in [0, 0.999]
        self._dirty = True
        self._curves: dict[str, pg.PlotDataItem] = {}
        self._raw: dict[str, pg.PlotDataItem] = {}
        self._stack: list[pg.PlotDataItem] = []
        self._stack_tops: np.ndarray | None = None
        self._pyramids: dict[str, tuple[PeakPyramid, int]] = {}
        self._ema: dict[str, EmaCache] = {}
        self._syncing = False
        self.auto_x = True  # the x range follows the data, growing in steps (see _follow_x)
        self._x_span: tuple[float, float] | None = None
        self.after_paint = None  # called once the view has painted (the window ends a run's hold there)

        self.header = self.addLabel("", row=0, col=0, colspan=2, justify="left")
        self.loss = self.addPlot(row=1, col=0, colspan=2)
        self.metric = self.addPlot(row=2, col=0)
        self.throughput = self.addPlot(row=2, col=1)
        self.util = self.addPlot(row=3, col=0)
        self.memory = self.addPlot(row=3, col=1)
        self.phases = self.addPlot(row=4, col=0, colspan=2)
        titles = [
            "Loss (per device, combined, validation)",
            "Validation metric",
            "Throughput (samples/s)",
            "Utilization / CPU lane busy (%)",
            "Memory (MiB)",
            "Step time split (ms, stacked)",
        ]
        self.ci.layout.setRowStretchFactor(1, 3)
        for r in (2, 3, 4):
            self.ci.layout.setRowStretchFactor(r, 2)
        self.plots = [self.loss, self.metric, self.throughput, self.util, self.memory, self.phases]
        for p, title in zip(self.plots, titles, strict=True):
            p.setTitle(title, size="10pt")
            for axis in ("left", "bottom"):
                ax = p.getAxis(axis)
                # An opaque light-grey grid: pyqtgraph's default translucent one (tick pen at alpha
                # 0.2) doubled the cost of a repaint (15 ms against 8, bench/gui_paint.py).
                # Major ticks only: opaque minor lines too made a dense mesh.
                ax.setStyle(tickFont=_TICK_FONT, tickAlpha=255, maxTickLevel=0)
                ax.setTickPen(pg.mkPen(GRID_COLOR))
                ax.setZValue(-200)  # the grid under the view box: under the curves and the legend
            p.showGrid(x=True, y=True)
            p.addLegend(offset=(-5, 5), labelTextSize="8pt", verSpacing=-6, brush=pg.mkBrush(255, 255, 255, 170))
            # One x range for all. Not setXLink: it lines views up by screen pixels, which halves
            # the range of the half-width plots.
            p.sigXRangeChanged.connect(self._sync_x)
            # x follows the data in steps (_follow_x), not at every point: a changed range repaints
            # every axis of every plot, the largest part of a redraw
            p.enableAutoRange(axis="x", enable=False)
        self.util.setYRange(0, 100)
        self.phases.legend.setColumnCount(3)  # six phases in two rows: one column overflowed the plot
        self._set_x_label()
        self._lines = []
        for p in self.plots:
            line = pg.InfiniteLine(angle=90, movable=False, pen=pg.mkPen("#888", style=Qt.DashLine))
            line.setVisible(False)
            p.addItem(line, ignoreBounds=True)
            self._lines.append(line)
        self._proxy = pg.SignalProxy(self.scene().sigMouseMoved, rateLimit=30, slot=self._on_mouse)
        # The right-click menu's "Export..." is pyqtgraph's dialog, whose SVG exporter raises ValueError
        # with PySide6 6.12 and whose CSV holds only the decimated curve of one plot. Ours instead:
        # the app's export (PNG at a chosen width, SVG through QSvgGenerator, every logged metric as CSV).
        self.export_actions = []
        for text, what in (("Export plots and CSV…", "plots"), ("Export bundle…", "bundle")):
            action = QAction(text, self.scene())
            action.triggered.connect(lambda _checked=False, w=what: self.sigExportRequested.emit(w))
            self.export_actions.append(action)
        self.scene().contextMenu = list(self.export_actions)

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

    # -- data ------------------------------------------------------------------------------------
    def reset(self, data: RunData | None = None) -> None:
        """Show a new run (live or loaded), dropping the curves of the previous one."""
        for p in self.plots:
            for item in list(p.listDataItems()):
                p.removeItem(item)
            if p.legend is not None:
                p.legend.clear()
        self._curves.clear()
        self._raw.clear()
        self._stack.clear()
        self._stack_tops = None
        self._pyramids.clear()
        self._ema.clear()
        self.overlays.clear()
        self.data = data or RunData()
        self._dirty = True
        self.refresh()

    def add_record(self, rec: dict) -> None:
        self.data.add(rec)
        self._dirty = True

    def add_overlay(self, run: RunData) -> None:
        """Overlay a past run's combined and validation loss, dashed, for comparison."""
        color = PALETTE[(len(self.overlays) + 3) % len(PALETTE)]
        items = [
            _curve(self.loss, color, f"{run.name}: loss", style=Qt.DashLine),
            _curve(self.loss, color, f"{run.name}: val", style=Qt.DotLine, width=2),
        ]
        self.overlays.append((run, items))
        self._dirty = True

    def set_x_mode(self, mode: str) -> None:
        self.x_mode = mode
        self._set_x_label()
        self._dirty = True
        self._x_span = None
        self.refresh()
        self.set_auto_range(True)

    def set_smoothing(self, alpha: float) -> None:
        self.smoothing = alpha
        self._dirty = True

    def set_log_y(self, on: bool) -> None:
        self.loss.setLogMode(y=on)

    def set_auto_range(self, on: bool) -> None:
        self.auto_x = on
        self._x_span = None
        for p in self.plots:
            if on and p is not self.util:
                p.enableAutoRange(axis="y")
            elif not on:
                p.disableAutoRange()
        self.util.setYRange(0, 100, padding=0.02)  # a percentage: a fixed axis, never repainted for it
        self._dirty = True
        self.refresh()

    def _follow_x(self, lo: float, hi: float) -> None:
        """Keep all data in view, growing the range by a quarter when the data reaches its end."""
        span = self._x_span
        if span is not None and span[0] <= lo and hi <= span[1] and (hi - lo) > 0.5 * (span[1] - span[0]):
            return
        width = max(hi - lo, 1e-9)
        new = (lo, hi + 0.25 * width if span is not None else hi + 0.05 * width)
        self._x_span = new
        self._syncing = True
        try:
            for p in self.plots:
                p.setXRange(*new, padding=0)
        finally:
            self._syncing = False

    def _set_x_label(self) -> None:
        self.phases.setLabel("bottom", "step" if self.x_mode == "step" else "elapsed time (s)")

    def _x(self, data: RunData, series: Series) -> np.ndarray:
        if self.x_mode == "step":
            return series.get("step")
        return series.get("wall_time") - (data.t0 or 0.0)

    # -- drawing ---------------------------------------------------------------------------------
    def _item(self, key: str, plot: pg.PlotItem, color: str, name: str, **kw) -> pg.PlotDataItem:
        item = self._curves.get(key)
        if item is None:
            item = self._curves[key] = _curve(plot, color, name, **kw)
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
                raw = self._raw[key] = _curve(plot, color, None, width=1, alpha=60)
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

    def paintEvent(self, ev) -> None:
        super().paintEvent(ev)
        if self.after_paint is not None:
            self.after_paint()

    @property
    def dirty(self) -> bool:
        return self._dirty

    def refresh(self) -> None:
        """Redraw what changed since the last call (the app calls it from a QTimer)."""
        if not self._dirty:
            return
        self._dirty = False
        d = self.data
        tr, ev, te = d.train, d.eval, d.telemetry
        if self.auto_x:
            ends = [(self._x(d, s)[0], self._x(d, s)[-1]) for s in (tr, ev, te) if s.rows]
            ends += [(self._x(r, r.train)[0], self._x(r, r.train)[-1]) for r, _ in self.overlays if r.train.rows]
            if ends:
                self._follow_x(min(a for a, _ in ends), max(b for _, b in ends))
        if tr.rows:
            x = self._x(d, tr)
            for i, dev in enumerate(d.devices):
                self._smoothed(f"loss/{dev}", self.loss, PALETTE[i % len(PALETTE)], dev, x, tr.get(f"loss/{dev}"), 1)
            if "loss" in tr.columns:
                self._smoothed("loss", self.loss, "#000000", "combined", x, tr.get("loss"), 2)
            if "samples_per_s" in tr.columns:
                self._show(
                    "throughput",
                    self._item("throughput", self.throughput, "#444", "samples/s"),
                    x,
                    tr.get("samples_per_s"),
                )
            self._draw_stack(x, tr)
        if ev.rows:
            x = self._x(d, ev)
            val = self._item("val", self.loss, "#d62728", "validation", width=2, style=Qt.DashLine)
            if val.opts["symbol"] is None and ev.rows <= 200:
                val.setSymbol("o")
                val.setSymbolSize(5)
            elif ev.rows > 200:
                val.setSymbol(None)
            self._show("val", val, x, ev.get("val_loss"))
            for i, m in enumerate(d.metric_names):
                item = self._item(f"metric/{m}", self.metric, PALETTE[(i + 2) % len(PALETTE)], m, width=2)
                self._show(f"metric/{m}", item, x, ev.get(f"metric/{m}"))
        if te.rows:
            x = self._x(d, te)
            names = sorted({k.split("/", 1)[1] for k in te.names("util/") + te.names("mem/") + te.names("alloc/")})
            for i, dev in enumerate(names):
                color = PALETTE[i % len(PALETTE)]
                for prefix, plot, label, style in (
                    ("util", self.util, dev, Qt.SolidLine),
                    ("mem", self.memory, f"{dev} used", Qt.SolidLine),
                    ("alloc", self.memory, f"{dev} torch", Qt.DashLine),
                ):
                    key = f"{prefix}/{dev}"
                    if key in te.columns:
                        self._show(key, self._item(key, plot, color, label, style=style), x, te.get(key))
            if "rss_mb" in te.columns and not te.names("mem/"):  # CPU lanes: the process's memory
                self._show("rss", self._item("rss", self.memory, "#555", "process RSS"), x, te.get("rss_mb"))
        for k, (run, (loss_item, val_item)) in enumerate(self.overlays):
            if run.train.rows:
                self._show(f"overlay{k}:loss", loss_item, self._x(run, run.train), run.train.get("loss"))
            if run.eval.rows:
                self._show(f"overlay{k}:val", val_item, self._x(run, run.eval), run.eval.get("val_loss"))

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

    # -- crosshair -------------------------------------------------------------------------------
    def _on_mouse(self, event) -> None:
        pos = event[0]
        for p in self.plots:
            if p.sceneBoundingRect().contains(pos):
                x = p.vb.mapSceneToView(pos).x()
                self.show_values_at(x)
                return

    def show_values_at(self, x: float) -> str:
        """Move every plot's crosshair to ``x`` and show every curve's value there in the header."""
        for line in self._lines:
            line.setPos(x)
            line.setVisible(True)
        d = self.data
        parts = [f"{'step' if self.x_mode == 'step' else 't'} {x:,.1f}"]
        for series, keys in (
            (d.train, ["loss"] + [f"loss/{dev}" for dev in d.devices] + ["samples_per_s"]),
            (d.eval, ["val_loss"] + [f"metric/{m}" for m in d.metric_names]),
            (d.telemetry, d.telemetry.names("util/") + d.telemetry.names("mem/")),
        ):
            if not series.rows:
                continue
            xs = self._x(d, series)
            i = int(np.clip(np.searchsorted(xs, x), 0, series.rows - 1))
            if i > 0 and abs(xs[i - 1] - x) < abs(xs[i] - x):
                i -= 1
            for k in keys:
                v = series.get(k)[i]
                if np.isfinite(v):
                    parts.append(f"{k.replace('loss/', '').replace('metric/', '')} {v:.4g}")
        text = " · ".join(parts)
        self.header.setText(text, size="9pt")
        return text
