"""The live plots: loss per device, combined and validation; metric; throughput; utilization; memory;
the step time split. All share one x axis (step or wall time) and one crosshair.

Data stays in numpy columns (``RunData``); a QTimer calls ``refresh()`` at 10–20 Hz, and nothing is
redrawn when no data came. Each curve is peak-decimated to a few points per pixel of what is in view
(``decimate.PeakPyramid``, extended incrementally), so a run of a million steps stays smooth and its
spikes stay visible; smoothing (EMA) runs on the full data, also incrementally.
"""

from __future__ import annotations

import time

import numpy as np
import pyqtgraph as pg
from multilane.engine.rundir.follow import TERMINAL_STATES
from multilane.gui.plots.curves import CurveDrawing
from multilane.gui.plots.decimate import EmaCache, PeakPyramid
from multilane.gui.plots.items import KeyLabel, SparseLogAxis, WrappingLabel, set_plot_title, swatch, wrap_title
from multilane.gui.plots.marks import PlotMarks
from multilane.gui.plots.palette import COMBINED, NEUTRAL, VALIDATION, device_width, series_color
from multilane.gui.plots.ranges import SharedXRange
from multilane.gui.plots.run_view import THROUGHPUT_TITLES, metric_title
from multilane.gui.plots.style import GRID_COLOR, PHASE_COLORS, PHASES, PROCESS_MEMORY, TICK_FONT
from multilane.gui.runs.run_data import RunData, Series
from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QAction


class PlotPanel(SharedXRange, CurveDrawing, PlotMarks, pg.GraphicsLayoutWidget):
    """Every live plot of one run (plus overlaid past runs, for comparison).

    No plot carries a legend (a legend inside a plot covers data): colours mean the same everywhere,
    a device's colour in the loss is its colour in utilization and memory, and one key over the plots
    names them. The hover header names each value with its unit.
    """

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
        self.paint_s = 0.0  # seconds spent painting since the window last took it (its redraw pace)
        self.title_text = ""
        self._key_state: tuple = ()
        self._pause_items: list = []
        self._pause_state: tuple = ()
        self._memory_title = ""
        self._tops: dict[int, float] = {}  # y top of the plots whose axis starts at zero
        self.empty_panels: dict[str, str] = {}  # a panel hidden for want of data: why
        self._metric_title = "Validation metric"
        self._hidden: set[str] = set()  # key entries the user clicked off: "dev:cpu:0", "combined", "run:1", …
        self._break_cache: dict[tuple, np.ndarray] = {}
        self.power: pg.PlotItem | None = None
        self.temperature: pg.PlotItem | None = None
        self.compact = False  # only the loss (the Sweep tab's trial curves): set_compact
        self._min_heights: dict[int, float] = {}

        self.header = WrappingLabel("", justify="left")
        self.header.min_lines = 2
        self.addItem(self.header, row=0, col=0, colspan=3)
        self.key = KeyLabel(self.toggle_curve)
        self.addItem(self.key, row=1, col=0, colspan=3)
        # each key entry is a link: a click hides or shows its curves (toggle_curve)
        # The loss, as wide and tall as the panel allows; three small plots a row under it, so that
        # at 1024×700 the loss still gets most of the height.
        self.loss = self.addPlot(row=2, col=0, colspan=3, axisItems={"left": SparseLogAxis("left")})
        self.metric_plot = self.addPlot(row=3, col=0)
        self.throughput = self.addPlot(row=3, col=1)
        self.lr = self.addPlot(row=3, col=2)
        self.util = self.addPlot(row=4, col=0)
        self.memory = self.addPlot(row=4, col=1)
        self.grad_norm = self.addPlot(row=4, col=2)
        self.phases = self.addPlot(row=5, col=0, colspan=3)
        phase_key = " ".join(
            f"{swatch(c)}&nbsp;{p}" for p, c in zip(PHASES, PHASE_COLORS, strict=True)
        )  # a name wraps with its swatch
        titles = [
            "Loss",
            "Validation metric",
            "Throughput (samples/s)",
            "Learning rate",
            "Utilization (%)",
            "Memory (MiB)",
            "Gradient norm",
            f"Step time (ms) &nbsp; {phase_key}",
        ]
        self.phase_title = titles[-1]  # comparing runs, the step time names the runs instead (marks.py)
        self.ci.layout.setRowStretchFactor(2, 5)
        for r in (3, 4, 5):  # row 6 (power, temperature) gets its share once it has plots
            self.ci.layout.setRowStretchFactor(r, 2)
        self.plots: list[pg.PlotItem] = []
        self._lines = []
        plots = [
            self.loss,
            self.metric_plot,
            self.throughput,
            self.lr,
            self.util,
            self.memory,
            self.grad_norm,
            self.phases,
        ]
        for p, title in zip(plots, titles, strict=True):
            self._style_plot(p, title)
        self.util.setYRange(0, 100)
        self.zero_based = (self.memory, self.lr)  # y from zero, set in refresh(): see _from_zero
        for p in self.zero_based:
            p.enableAutoRange(axis="y", enable=False)
        self._set_x_label()
        self._proxy = pg.SignalProxy(self.scene().sigMouseMoved, rateLimit=30, slot=self._on_mouse)
        # The right-click menu's "Export..." is pyqtgraph's dialog, whose SVG exporter raises ValueError
        # with PySide6 6.12 and whose CSV holds only the decimated curve of one plot. Ours instead.
        self.export_actions = []
        for text, what in (("Export figures and CSV…", "plots"), ("Export bundle…", "bundle")):
            action = QAction(text, self.scene())
            action.triggered.connect(lambda _checked=False, w=what: self.sigExportRequested.emit(w))
            self.export_actions.append(action)
        self.scene().contextMenu = list(self.export_actions)

    def _style_plot(self, p: pg.PlotItem, title: str) -> None:
        wrap_title(p)
        set_plot_title(p, title)
        for axis in ("left", "bottom"):
            ax = p.getAxis(axis)
            # An opaque light-grey grid: pyqtgraph's default translucent one (tick pen at alpha
            # 0.2) doubled the cost of a repaint (15 ms against 8, bench/gui_paint.py).
            # Major ticks only: opaque minor lines too made a dense mesh.
            ax.setStyle(tickFont=TICK_FONT, tickAlpha=255, maxTickLevel=0)
            ax.setTickPen(pg.mkPen(GRID_COLOR))
            ax.setZValue(-200)  # the grid under the view box: under the curves
        p.showGrid(x=True, y=True)
        # One x range for all. Not setXLink: it lines views up by screen pixels, which halves
        # the range of the half-width plots.
        p.sigXRangeChanged.connect(self._sync_x)
        # x follows the data in steps (_follow_x), not at every point: a changed range repaints
        # every axis of every plot, the largest part of a redraw
        p.enableAutoRange(axis="x", enable=False)
        p.vb.setLimits(xMin=0.0)  # no step or second before the run's start: no panning there
        line = pg.InfiniteLine(angle=90, movable=False, pen=pg.mkPen("#888", style=Qt.DashLine))
        line.setVisible(False)
        p.addItem(line, ignoreBounds=True)
        self._lines.append(line)
        if self._x_span is not None:
            p.setXRange(*self._x_span, padding=0)
        self.plots.append(p)

    def set_compact(self, compact: bool) -> None:
        """Only the loss plot, with its header and key (the Sweep tab shows the selected trials' curves
        under the sweep, where every plot would not fit); False: every plot again."""
        if compact == self.compact:
            return
        self.compact = compact
        small = [self.metric_plot, self.throughput, self.lr, self.util, self.memory, self.grad_norm, self.phases]
        for p in [*small, self.power, self.temperature]:
            if p is not None:
                p.setVisible(not compact)
                # a hidden item keeps its row's height otherwise
                self._min_heights.setdefault(id(p), p.minimumHeight())
                p.setMinimumHeight(0 if compact else self._min_heights[id(p)])
                p.setMaximumHeight(0 if compact else 16777215)
        lay = self.ci.layout
        for r in (3, 4, 5, 6):
            if compact:
                lay.setRowFixedHeight(r, 0)
                lay.setRowStretchFactor(r, 0)
            else:
                lay.setRowMinimumHeight(r, 0)
                lay.setRowMaximumHeight(r, 1e6)
                lay.setRowStretchFactor(r, 2 if r < 6 or self.power or self.temperature else 0)
        lay.setRowSpacing(2, 0 if compact else lay.verticalSpacing())

    # -- data ------------------------------------------------------------------------------------
    def reset(self, data: RunData | None = None) -> None:
        """Show a new run (live or loaded), dropping the curves of the previous one."""
        for p in self.plots:
            for item in list(p.listDataItems()):
                p.removeItem(item)
        self._clear_pauses()
        self._curves.clear()
        self._raw.clear()
        self._stack.clear()
        self._stack_tops = None
        self._pyramids.clear()
        self._ema.clear()
        self.overlays.clear()
        self._key_state = ()
        self._hidden.clear()
        self._tops.clear()
        self.data = data or RunData()
        self._x_span = None
        self._clear_axes()
        self._dirty = True
        self.refresh()

    def _clear_axes(self) -> None:
        """Axes as for no data: a new run (or none) never shows the previous run's ranges and titles."""
        self._set_span((0.0, 1.0))
        self._x_span = None  # the first data sets the span afresh
        for p in self.plots:
            if p is self.util:
                continue
            p.setYRange(0.0, 1.0, padding=0)
            if self.auto_x and p not in self.zero_based:
                p.enableAutoRange(axis="y")
        self._memory_title = ""
        set_plot_title(self.memory, "Memory (MiB)")

    def add_record(self, rec: dict) -> None:
        self.data.add(rec)
        self._dirty = True

    def add_overlay(self, run: RunData) -> None:
        """Compare with a past run: each run in its own colour in every panel, the settings that differ
        between the runs in the key."""
        self.overlays.append((run, []))  # its curves are made as its data is drawn (compare.py)
        self._x_span = None
        self._dirty = True

    def set_title(self, text: str) -> None:
        """What the header says when the mouse is not over a plot: the run's name and devices."""
        self.title_text = text
        self.header.setText(text, size="9pt")

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

    # -- drawing ---------------------------------------------------------------------------------
    def paintEvent(self, ev) -> None:
        t0 = time.perf_counter()
        super().paintEvent(ev)
        self.paint_s += time.perf_counter() - t0
        if self.after_paint is not None:
            self.after_paint()

    @property
    def dirty(self) -> bool:
        return self._dirty

    def _device_color(self, dev: str) -> str:
        return series_color(self.data.device_index(dev))

    def refresh(self) -> None:
        """Redraw what changed since the last call (the app calls it from a QTimer)."""
        if not self._dirty:
            return
        self._dirty = False
        self._break_cache.clear()
        d = self.data
        tr, ev, te = d.train, d.eval, d.telemetry
        comparing = bool(self.overlays)
        if self.auto_x:
            ends = self._x_ends()
            if ends:
                self._follow_x(*ends)
        if comparing:  # one colour per run in every panel (compare.py); the shown run's own curves hidden
            self._draw_comparison()
        if tr.rows and not comparing:
            x, br = self._x(d, tr), self._breaks(d, tr)
            n = len(d.devices)
            for i, dev in enumerate(d.devices):
                width = device_width(i, n, 3.0, 1.5)
                self._smoothed(
                    f"loss/{dev}", self.loss, self._device_color(dev), dev, x, tr.get(f"loss/{dev}"), width, br
                )
                self._curves[f"loss/{dev}"].setZValue(1 + i)
            if "loss" in tr.columns:
                # thin and on top: every device's colour shows around it (docs/app.md)
                self._smoothed("loss", self.loss, COMBINED, "combined", x, tr.get("loss"), 1.0, br)
                self._curves["loss"].setZValue(20)
            if self.throughput.titleLabel.text != (title := THROUGHPUT_TITLES[d.throughput_key]):
                set_plot_title(self.throughput, title)  # tokens/s for a language model's run
            for key, plot in ((d.throughput_key, self.throughput), ("lr", self.lr), ("grad_norm", self.grad_norm)):
                if key in tr.columns:
                    self._show(key, self._item(key, plot, NEUTRAL, key), x, tr.get(key), br)
            if "lr" in tr.columns:
                self._from_zero(self.lr, [tr.get("lr")])
            self._draw_stack(x, tr, br)
        if ev.rows and not comparing:
            x, br = self._x(d, ev), self._breaks(d, ev)
            val = self._item("val", self.loss, VALIDATION, "validation", width=2, style=Qt.DashLine)
            val.setZValue(21)
            val.keep_symbol = ev.rows <= 200
            if val.opts["symbol"] is None and ev.rows <= 200:
                val.setSymbol("o")
                val.setSymbolSize(6)
                val.setSymbolPen(pg.mkPen(VALIDATION))
                val.setSymbolBrush(pg.mkBrush(VALIDATION))
            elif ev.rows > 200:
                val.setSymbol(None)
            self._show("val", val, x, ev.get("val_loss"), br)
            for i, m in enumerate(d.metric_names):
                item = self._item(f"metric/{m}", self.metric_plot, NEUTRAL if i == 0 else series_color(i), m, width=2)
                self._show(f"metric/{m}", item, x, ev.get(f"metric/{m}"), br)
        if te.rows and not comparing:
            self._draw_telemetry(te)
        self._set_metric_title()
        self._hide_empty()
        self._apply_visibility()
        self._update_key()
        self._draw_pauses()

    def _hide_empty(self) -> None:
        """A panel that has nothing to show is hidden, not drawn as empty axes; the key says why (marks.py):
        the gradient norm of a run that logged none (runs that clipped no gradient, before it was always
        logged), the validation metric of a task that reports none (known at its first evaluation)."""
        runs = [self.data, *(r for r, _ in self.overlays)]
        trained = [r for r in runs if r.train.rows]
        evaluated = [r for r in runs if r.eval.rows]
        ended = all(any(e.get("event") in TERMINAL_STATES for e in r.events) for r in runs)  # its last event
        self.empty_panels = {}
        if trained and not any("grad_norm" in r.train.columns for r in trained):
            self.empty_panels["gradient norm"] = "not logged by this run"
        if evaluated and not any(r.metric_names for r in evaluated):
            self.empty_panels["validation metric"] = "the task reports none"
        elif trained and not evaluated and ended:
            self.empty_panels["validation metric"] = "no evaluation in this run"
        for plot, name in ((self.grad_norm, "gradient norm"), (self.metric_plot, "validation metric")):
            plot.setVisible(name not in self.empty_panels and not self.compact)

    def _set_metric_title(self) -> None:
        names = list(dict.fromkeys(m for r in (self.data, *(r for r, _ in self.overlays)) for m in r.metric_names))
        title = metric_title(names)
        if title != self._metric_title:
            self._metric_title = title
            set_plot_title(self.metric_plot, title)

    def _draw_telemetry(self, te: Series) -> None:
        d = self.data
        x = self._x(d, te)
        names = sorted({k.split("/", 1)[1] for k in te.names("util/") + te.names("mem/") + te.names("alloc/")})
        if te.names("power/") and self.power is None:
            self.power = self.addPlot(row=6, col=0)
            self.ci.layout.setRowStretchFactor(6, 2)
            self._style_plot(self.power, "Power (W)")
            self.power.setVisible(not self.compact)
        if te.names("temp/") and self.temperature is None:
            self.temperature = self.addPlot(row=6, col=1)
            self.ci.layout.setRowStretchFactor(6, 2)
            self._style_plot(self.temperature, "Temperature (°C)")
            self.temperature.setVisible(not self.compact)
        for j, dev in enumerate(names):
            color = self._device_color(dev)
            width = device_width(j, len(names), 2.0, 1.0)  # equal lanes (or ranks) must not hide each other
            for prefix, plot, label, style in (
                ("util", self.util, dev, Qt.SolidLine),
                ("mem", self.memory, f"{dev} used", Qt.SolidLine),
                ("alloc", self.memory, f"{dev} torch", Qt.DashLine),
                ("power", self.power, dev, Qt.SolidLine),
                ("temp", self.temperature, dev, Qt.SolidLine),
            ):
                key = f"{prefix}/{dev}"
                if key in te.columns and plot is not None:
                    item = self._item(key, plot, color, label, style=style, width=width)
                    item.setZValue(j)
                    self._show_finite(key, item, x, te.get(key))
        cpu_only = not te.names("mem/") and ("rss_mb" in te.columns or bool(te.names("rss/")))
        if cpu_only and te.names("rss/"):  # ddp on CPU: each rank is a process of its own
            ranks = te.names("rss/")
            for j, key in enumerate(ranks):
                dev = key.split("/", 1)[1]
                width = device_width(j, len(ranks), 2.0, 1.0)  # equal ranks: both colours show
                item = self._item(key, self.memory, self._device_color(dev), f"{dev} RSS", width=width)
                item.setZValue(j)
                self._show_finite(key, item, x, te.get(key))
        elif cpu_only:  # CPU lanes: the process's memory
            self._show_finite("rss", self._item("rss", self.memory, NEUTRAL, "process RSS"), x, te.get("rss_mb"))
        title = PROCESS_MEMORY if cpu_only else "Memory used (MiB), dashed: torch's tensors"
        if title != self._memory_title and (cpu_only or te.names("mem/")):
            self._memory_title = title
            set_plot_title(self.memory, title)
        keys = ["rss_mb", *te.names("rss/")] if cpu_only else te.names("mem/") + te.names("alloc/")
        self._from_zero(self.memory, [te.get(k) for k in keys])
