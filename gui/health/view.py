"""The Health view: a heatmap of layers × sampled steps for each quantity, and the noise scale.

The heatmap draws the run's ``health`` records as they are: one column per sampled step, one row per
layer (or block), the colour the value's log10 for the norms and ratios (a linear scale for the
activations' mean and fraction of zeros), a missing value left transparent. An exact zero on the log scale
(a dead layer's gradient, a frozen one's update) is drawn one decade under the smallest value, the bottom
of the colour bar, never blank: the sickest rows must not look empty. Hovering names the layer, the step
and the value. Above it, the diagnosis (engine/health/diagnosis.py): the few layers that need attention
and why, each a click away from its row. Below it, the run's noise scale ``B_simple`` per logged step,
its 95 % band shaded, with the run's batch as a line (all in the y range), and the verdict
(engine/health/noise_scale.py: only where the band is clear of the batch). A
run that sampled no health says why (the NaN that ended it first). Redrawn from the run's lists on the
window's timer, only while the view is shown.
"""

from __future__ import annotations

import html
import math

import numpy as np
import pyqtgraph as pg
from multilane.engine.health.diagnosis import Finding, diagnose
from multilane.engine.health.monitor import ONE_DEVICE
from multilane.engine.health.noise_scale import batch_text, unit_word, verdict
from multilane.gui.runs.run_data import RunData
from PySide6.QtCore import QRectF
from PySide6.QtWidgets import QComboBox, QHBoxLayout, QLabel, QListWidget, QListWidgetItem, QVBoxLayout, QWidget

QUANTITIES = {
    "grad_norm": ("gradient norm", "rows", True),
    "weight_norm": ("weight norm", "rows", True),
    "update_ratio": ("update / weight (‖Δw‖/‖w‖)", "rows", True),
    "act_mean": ("activation mean", "act_rows", False),
    "act_std": ("activation std", "act_rows", True),
    "act_zero": ("activation: fraction of exact zeros", "act_rows", False),
}


def matrix(records: list[dict], quantity: str) -> tuple[list[str], list[int], np.ndarray]:
    """``(row names, steps, values[row, step])`` of ``quantity``; NaN where a record has no value."""
    _, rows_key, _ = QUANTITIES[quantity]
    recs = [r for r in records if r.get(quantity) is not None and r.get(rows_key)]
    if not recs:
        return [], [], np.zeros((0, 0))
    names = list(recs[-1][rows_key])
    where = {n: i for i, n in enumerate(names)}
    out = np.full((len(names), len(recs)), np.nan)
    for j, r in enumerate(recs):
        for name, v in zip(r[rows_key], r[quantity], strict=False):
            i = where.get(name)
            if i is not None and isinstance(v, (int, float)) and math.isfinite(v):
                out[i, j] = v
    return names, [int(r["step"]) for r in recs], out


class HealthView(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.data = RunData()
        self._state: tuple | None = None
        self.quantity = QComboBox()
        for key, (label, _, _) in QUANTITIES.items():
            self.quantity.addItem(label, key)
        self.quantity.currentIndexChanged.connect(lambda _: self.refresh(force=True))
        self.hover = QLabel("")
        self.hover.setObjectName("health.hover")
        self.noise_line = QLabel("")
        self.noise_line.setObjectName("health.noise")
        bar = QHBoxLayout()
        bar.addWidget(QLabel("quantity"))
        bar.addWidget(self.quantity)
        bar.addSpacing(12)
        bar.addWidget(self.hover, 1)
        self.diagnosis = QListWidget()
        self.diagnosis.setObjectName("health.diagnosis")
        self.diagnosis.setToolTip("The layers that need attention and why; click one to show its row")
        self.diagnosis.itemClicked.connect(self._select_finding)
        self.diagnosis.setVisible(False)
        self.findings: list[Finding] = []
        self.canvas = pg.GraphicsLayoutWidget()
        self.canvas.setBackground("w")
        self.heat = self.canvas.addPlot(row=0, col=0)
        self.heat.setLabel("bottom", "step")
        self.image = pg.ImageItem()
        self.image.setColorMap(pg.colormap.get("viridis"))
        self.heat.addItem(self.image)
        self.selected = pg.LinearRegionItem(orientation="horizontal", movable=False, brush=(214, 39, 40, 40))
        self.selected.setVisible(False)
        self.heat.addItem(self.selected, ignoreBounds=True)
        self.bar = pg.ColorBarItem(colorMap=pg.colormap.get("viridis"), interactive=False, width=12)
        self.bar.setImageItem(self.image, insert_in=self.heat)
        self.noise = self.canvas.addPlot(row=1, col=0)
        self.noise.setLabel("left", "noise scale B_simple")
        self.noise.setLabel("bottom", "step")
        self.noise.setXLink(self.heat)
        # the 95 % band: two faint edges and the fill between them, under the curve
        edge = pg.mkPen((31, 119, 180, 90), width=1)
        self.band_lo = pg.PlotDataItem([], [], pen=edge)
        self.band_hi = pg.PlotDataItem([], [], pen=edge)
        self.band = pg.FillBetweenItem(self.band_lo, self.band_hi, brush=pg.mkBrush(31, 119, 180, 60))
        for item in (self.band_lo, self.band_hi, self.band):
            self.noise.addItem(item)
        self.noise_curve = self.noise.plot([], [], pen=pg.mkPen("#1f77b4", width=2), name="B_simple")
        self.batch_line = pg.InfiniteLine(angle=0, movable=False, pen=pg.mkPen("#d62728", style=pg.QtCore.Qt.DashLine))
        self.batch_label = pg.TextItem("", color="#d62728", anchor=(0, 1))
        self.noise.addItem(self.batch_line, ignoreBounds=True)
        self.noise.addItem(self.batch_label, ignoreBounds=True)
        self.canvas.ci.layout.setRowStretchFactor(0, 3)
        self.canvas.ci.layout.setRowStretchFactor(1, 2)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addLayout(bar)
        lay.addWidget(self.noise_line)
        lay.addWidget(self.diagnosis)
        lay.addWidget(self.canvas, 1)
        self._names: list[str] = []
        self._steps: list[int] = []
        self._values = np.zeros((0, 0))
        self.canvas.scene().sigMouseMoved.connect(self._on_mouse)

    def set_data(self, data: RunData) -> None:
        self.data = data
        self.refresh(force=True)

    def refresh(self, force: bool = False) -> None:
        d = self.data
        key = self.quantity.currentData()
        state = (id(d), key, len(d.health), d.noise.rows)
        if state == self._state and not force:
            return
        self._state = state
        self._draw_diagnosis()
        self._draw_heatmap(key)
        self._draw_noise()

    def _draw_heatmap(self, key: str) -> None:
        label, _, log = QUANTITIES[key]
        names, steps, values = matrix(self.data.health, key)
        self._names, self._steps, self._values = names, steps, values
        if not names:
            self.image.clear()
            self.selected.setVisible(False)
            self.heat.setTitle(self._why_empty(), size="9pt")
            return
        shown = values.copy()
        zero = None
        if log:
            positive = shown > 0
            exact_zero = shown == 0
            shown[~positive] = np.nan
            shown = np.log10(shown)
            if exact_zero.any():  # one decade under the smallest value (or -12 when all are zero)
                zero = float(np.nanmin(shown)) - 1.0 if positive.any() else -12.0
                shown[exact_zero] = zero
        finite = shown[np.isfinite(shown)]
        lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
        if hi <= lo:
            hi = lo + 1e-9
        self.image.setImage(shown.T, autoLevels=False, levels=(lo, hi))  # x: step, y: row
        self.bar.setLevels((lo, hi))
        width = float(np.median(np.diff(steps))) if len(steps) > 1 else 1.0
        self.image.setRect(QRectF(steps[0] - width / 2, -0.5, width * len(steps), len(names)))
        self.heat.getAxis("left").setTicks([[(i, n) for i, n in enumerate(names)]])
        self.heat.invertY(True)
        scale = " (log10 colour; exact 0 at the bar's bottom)" if zero is not None else " (log10 colour)" if log else ""
        self.heat.setTitle(f"{label}{scale}: layers × sampled steps", size="9pt")
        self._show_selected()

    def _why_empty(self) -> str:
        """The heatmap's title when there is nothing to draw: why, the NaN that ended the run first."""
        origin = self.data.nan_origin
        if origin is not None and not self.data.health:
            return html.escape(f"no health sampled before the loss went non-finite: {origin.get('message', '')}")
        return "no health sampled yet (health.every)"

    def _draw_diagnosis(self) -> None:
        findings = diagnose(self.data.health, self.data.nan_origin)
        if findings == self.findings and self.diagnosis.count() == len(findings):
            return
        self.findings = findings
        self.diagnosis.clear()
        for f in findings:
            item = QListWidgetItem(f.text)
            item.setToolTip(f.text)
            self.diagnosis.addItem(item)
        self.diagnosis.setVisible(bool(findings))
        rows = min(len(findings), 5)
        self.diagnosis.setFixedHeight(self.diagnosis.sizeHintForRow(0) * rows + 6 if rows else 0)

    def _select_finding(self, item: QListWidgetItem) -> None:
        self.select_finding(self.diagnosis.row(item))

    def select_finding(self, k: int) -> None:
        """Show finding ``k``: its quantity in the heatmap, its layer's row marked."""
        f = self.findings[k]
        self._selected_row = f.row
        index = self.quantity.findData(f.quantity)
        if index >= 0 and index != self.quantity.currentIndex():
            self.quantity.setCurrentIndex(index)  # redraws, marking the row
        else:
            self._show_selected()

    def _show_selected(self) -> None:
        row = getattr(self, "_selected_row", None)
        if row in self._names:
            i = self._names.index(row)
            self.selected.setRegion((i - 0.5, i + 0.5))
            self.selected.setVisible(True)
        else:
            self.selected.setVisible(False)

    def _draw_noise(self) -> None:
        d = self.data
        steps, b = d.noise.get("step"), d.noise.get("b_simple")
        keep = np.isfinite(b)
        self.noise_curve.setData(steps[keep], b[keep])
        lo, hi = d.noise.get("lo"), d.noise.get("hi")
        banded = keep & np.isfinite(lo) & np.isfinite(hi)  # an unbounded band (null) is not drawn
        self.band_lo.setData(steps[banded], lo[banded])
        self.band_hi.setData(steps[banded], hi[banded])
        batch = d.noise.get("batch")
        top = max([*b[keep][-1:], *batch[np.isfinite(batch)][-1:]], default=0.0)
        # the band in view too, up to 3× the curve's or the batch's level (an early band can be very wide)
        known = np.concatenate([b[keep], batch[np.isfinite(batch)][-1:], np.minimum(hi[banded], 3 * top), lo[banded]])
        if known.size:  # the curve and the batch it is judged against, both in view
            top = float(known.max())
            self.noise.setYRange(min(0.0, float(known.min())), top * 1.1 if top > 0 else 1.0, padding=0)
        if d.noise.rows and np.isfinite(batch[-1]):
            last = float(b[keep][-1]) if keep.any() else None
            self.batch_line.setPos(float(batch[-1]))
            self.batch_line.setVisible(True)
            unit = unit_word(d.noise_unit)
            self.batch_label.setText(batch_text(float(batch[-1]), unit))
            self.batch_label.setPos(float(steps[0]), float(batch[-1]))
            band = [float(lo[-1]), float(hi[-1])] if np.isfinite(lo[-1]) and np.isfinite(hi[-1]) else [None, None]
            self.noise_line.setText(verdict(float(batch[-1]), last, unit, *band))
        else:
            self.batch_line.setVisible(False)
            self.batch_label.setText("")
            self.noise_line.setText(f"noise scale: {ONE_DEVICE}" if d.health and len(d.devices) < 2 else "")

    def _on_mouse(self, pos) -> None:
        if not self._names or not self.heat.sceneBoundingRect().contains(pos):
            self.hover.setText("")
            return
        p = self.heat.vb.mapSceneToView(pos)
        self.hover.setText(self.value_at(p.x(), p.y()))

    def value_at(self, x: float, y: float) -> str:
        """What the heatmap holds at step ``x``, row ``y``: "layer · step · value" (empty outside)."""
        if not self._names:
            return ""
        i = round(y)
        if not 0 <= i < len(self._names):
            return ""
        j = int(np.argmin([abs(s - x) for s in self._steps]))
        width = (self._steps[-1] - self._steps[0]) / max(1, len(self._steps) - 1) if len(self._steps) > 1 else 1
        if abs(self._steps[j] - x) > width / 2 + 1e-9:
            return ""
        v = self._values[i, j]
        label = QUANTITIES[self.quantity.currentData()][0]
        value = "no value" if not math.isfinite(v) else "0 (exact zero)" if v == 0 else f"{v:.4g}"
        return f"{self._names[i]} · step {self._steps[j]} · {label} {value}"
