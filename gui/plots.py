"""The live plots: loss per device, combined and validation; metric; throughput; utilization; memory;
the step time split. All share one x axis (step or wall time) and one crosshair.

Data stays in numpy columns (``RunData``); a QTimer calls ``refresh()`` 20 times a second, and only
plots whose data changed are redrawn. Curves use peak downsampling and clip-to-view, so a run of a
million steps stays smooth and its spikes stay visible.
"""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from multilane.gui.run_data import RunData, Series
from PySide6.QtCore import Qt
from PySide6.QtGui import QFont

PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf"]
PHASES = ["scatter", "replicate", "forward", "loss", "backward", "optimizer"]
PHASE_COLORS = ["#bcbd22", "#ff9896", "#1f77b4", "#9467bd", "#ff7f0e", "#2ca02c"]

pg.setConfigOptions(antialias=False, background="w", foreground="#333")
_TICK_FONT = QFont()
_TICK_FONT.setPointSize(8)


def ema(y: np.ndarray, alpha: float) -> np.ndarray:
    """Vectorised EMA (scipy.signal.lfilter) with NaNs carried forward."""
    if alpha <= 0 or len(y) == 0:
        return y
    from scipy.signal import lfilter

    finite = np.isfinite(y)
    if not finite.any():
        return y
    filled = y.copy()
    # carry the last finite value over gaps so the filter sees a continuous signal
    idx = np.where(finite, np.arange(len(y)), 0)
    np.maximum.accumulate(idx, out=idx)
    filled = y[idx]
    first = int(np.argmax(finite))
    filled[:first] = y[first]
    zi = np.array([alpha * filled[0]])
    out, _ = lfilter([1 - alpha], [1, -alpha], filled, zi=zi)
    out[~finite] = np.nan
    return out


def _curve(
    plot: pg.PlotItem, color: str, name: str | None = None, width: float = 1.5, style=Qt.SolidLine, alpha: int = 255
) -> pg.PlotDataItem:
    c = pg.mkColor(color)
    c.setAlpha(alpha)
    item = plot.plot([], [], pen=pg.mkPen(c, width=width, style=style), name=name, connect="finite")
    item.setDownsampling(auto=True, method="peak")
    item.setClipToView(True)
    return item


class PlotPanel(pg.GraphicsLayoutWidget):
    """Every live plot of one run (plus overlaid past runs, for comparison)."""

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
        self._syncing = False

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
                p.getAxis(axis).setStyle(tickFont=_TICK_FONT)
            p.showGrid(x=True, y=True, alpha=0.2)
            p.addLegend(offset=(-5, 5), labelTextSize="8pt", verSpacing=-6)
            # One x range for all. Not setXLink: it lines views up by screen pixels, which halves
            # the range of the half-width plots.
            p.sigXRangeChanged.connect(self._sync_x)
            if p is not self.loss:
                p.enableAutoRange(axis="x", enable=False)  # the loss plot leads the shared x axis
        self.util.setYRange(0, 100)
        self._set_x_label()
        self._lines = []
        for p in self.plots:
            line = pg.InfiniteLine(angle=90, movable=False, pen=pg.mkPen("#888", style=Qt.DashLine))
            line.setVisible(False)
            p.addItem(line, ignoreBounds=True)
            self._lines.append(line)
        self._proxy = pg.SignalProxy(self.scene().sigMouseMoved, rateLimit=30, slot=self._on_mouse)

    def _sync_x(self, source, x_range) -> None:
        if self._syncing:
            return
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
        self.refresh()
        self.set_auto_range(True)

    def set_smoothing(self, alpha: float) -> None:
        self.smoothing = alpha
        self._dirty = True

    def set_log_y(self, on: bool) -> None:
        self.loss.setLogMode(y=on)

    def set_auto_range(self, on: bool) -> None:
        for p in self.plots:
            if not on:
                p.disableAutoRange()
            elif p is self.loss:
                p.enableAutoRange()
            else:
                p.enableAutoRange(axis="y")

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

    def _smoothed(self, key: str, plot: pg.PlotItem, color: str, name: str, x, y, width=1.5) -> None:
        """A curve with EMA smoothing, the raw data faint behind it."""
        raw = self._raw.get(key)
        if self.smoothing > 0:
            if raw is None:
                raw = self._raw[key] = _curve(plot, color, None, width=1, alpha=60)
                raw.setZValue(-1)
            raw.setData(x, y)
            raw.setVisible(True)
            y = ema(y, self.smoothing)
        elif raw is not None:
            raw.setVisible(False)
        self._item(key, plot, color, name, width=width).setData(x, y)

    def refresh(self) -> None:
        """Redraw what changed since the last call (the app calls it from a QTimer)."""
        if not self._dirty:
            return
        self._dirty = False
        d = self.data
        tr, ev, te = d.train, d.eval, d.telemetry
        if tr.rows:
            x = self._x(d, tr)
            for i, dev in enumerate(d.devices):
                self._smoothed(f"loss/{dev}", self.loss, PALETTE[i % len(PALETTE)], dev, x, tr.get(f"loss/{dev}"), 1.2)
            self._smoothed("loss", self.loss, "#000000", "combined", x, tr.get("loss"), 2.2)
            self._item("throughput", self.throughput, "#444", "samples/s").setData(x, tr.get("samples_per_s"))
            self._draw_stack(x, tr)
        if ev.rows:
            x = self._x(d, ev)
            val = self._item("val", self.loss, "#d62728", "validation", width=2.5, style=Qt.DashLine)
            val.setData(x, ev.get("val_loss"))
            val.setSymbol("o")
            val.setSymbolSize(5)
            for i, m in enumerate(d.metric_names):
                self._item(f"metric/{m}", self.metric, PALETTE[(i + 2) % len(PALETTE)], m, width=2).setData(
                    x, ev.get(f"metric/{m}")
                )
        if te.rows:
            x = self._x(d, te)
            names = sorted({k.split("/", 1)[1] for k in te.names("util/") + te.names("mem/") + te.names("alloc/")})
            for i, dev in enumerate(names):
                color = PALETTE[i % len(PALETTE)]
                if f"util/{dev}" in te.columns:
                    self._item(f"util/{dev}", self.util, color, dev).setData(x, te.get(f"util/{dev}"))
                if f"mem/{dev}" in te.columns:
                    self._item(f"mem/{dev}", self.memory, color, f"{dev} used").setData(x, te.get(f"mem/{dev}"))
                if f"alloc/{dev}" in te.columns:
                    self._item(f"alloc/{dev}", self.memory, color, f"{dev} torch", style=Qt.DashLine).setData(
                        x, te.get(f"alloc/{dev}")
                    )
            if "rss_mb" in te.columns and not te.names("mem/"):  # CPU lanes: the process's memory
                self._item("rss", self.memory, "#555", "process RSS").setData(x, te.get("rss_mb"))
        for run, (loss_item, val_item) in self.overlays:
            if run.train.rows:
                loss_item.setData(self._x(run, run.train), run.train.get("loss"))
            if run.eval.rows:
                val_item.setData(self._x(run, run.eval), run.eval.get("val_loss"))

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
                item.setDownsampling(auto=True, method="peak")
                item.setClipToView(True)
                self._stack.append(item)
        total = np.zeros(tr.rows)
        tops = []
        for p in present:
            total = total + np.nan_to_num(tr.get(f"phase/{p}"))
            tops.append(total.copy())
        for item, top in zip(self._stack, reversed(tops), strict=True):
            item.setData(x, top)

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
