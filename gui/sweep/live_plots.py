"""The Sweep tab's live figures (pyqtgraph): parallel coordinates of the finished trials, the best one
marked, and the parameters' importances; both from ``figures.py``'s numbers, redrawn as trials finish."""

from __future__ import annotations

from typing import Any

import pyqtgraph as pg
from multilane.gui.sweep.figures import BEST, PRUNED, coordinates, importances
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QHBoxLayout, QWidget

BAR = "#332288"


class SweepPlots(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.coords = pg.PlotWidget(background="w")
        self.coords.setTitle("Trials (best: thick black; pruned: dashed)", color="#333", size="9pt")
        self.coords.hideAxis("left")
        self.coords.setMouseEnabled(False, False)
        self.bars = pg.PlotWidget(background="w")
        self.bars.setTitle("Parameter importance", color="#333", size="9pt")
        self.bars.setMouseEnabled(False, False)
        self.bars.getAxis("left").setWidth(96)  # room for the parameter names, whatever was drawn before
        lay = QHBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addWidget(self.coords, 3)
        lay.addWidget(self.bars, 2)
        self.setMinimumHeight(200)
        self.best: int | None = None
        self.placeholder: pg.TextItem | None = None  # "after two finished trials", while there are no importances

    def update_from(self, study: Any, keys: list[str], log_keys: set[str], objective: str, maximize: bool) -> None:
        c = coordinates(study, keys, log_keys, objective)
        self.best = c.best
        p = self.coords
        p.clear()
        xs = list(range(len(c.axes)))
        values = [v for _, _, v, s in c.lines if s == "complete" and v is not None]
        lo, hi = (min(values), max(values)) if values else (0.0, 1.0)
        cmap = pg.colormap.get("viridis")
        for number, ys, v, state in sorted(c.lines, key=lambda x: x[0] == c.best):
            if number == c.best:
                pen = pg.mkPen(BEST, width=3)
            elif state == "pruned":
                pen = pg.mkPen(PRUNED, width=1, style=Qt.DashLine)
            else:
                t = (v - lo) / ((hi - lo) or 1.0)
                pen = pg.mkPen(cmap.map(1 - t if not maximize else t, mode="qcolor"), width=1.5)
            p.plot(xs, ys, pen=pen)
        for x, ticks in zip(xs, c.ticks, strict=True):
            p.addItem(pg.InfiniteLine(pos=x, angle=90, pen=pg.mkPen("#999999")))
            for y, text in ticks:
                label = pg.TextItem(text, color="#333", anchor=(0, 0.5), fill=pg.mkBrush(255, 255, 255, 200))
                label.setPos(x, y)
                p.addItem(label)
        p.getAxis("bottom").setTicks([[(x, a.removeprefix("task.params.")) for x, a in zip(xs, c.axes, strict=True)]])
        p.setXRange(-0.25, max(1, len(xs) - 1) + 0.4, padding=0)
        p.setYRange(-0.05, 1.05, padding=0)
        imp = importances(study)
        b = self.bars
        b.clear()
        self.placeholder = None
        names = list(imp)[::-1]
        if names:
            b.addItem(
                pg.BarGraphItem(x0=0, y=list(range(len(names))), height=0.6, width=[imp[n] for n in names], brush=BAR)
            )
            b.getAxis("left").setTicks([[(i, n.removeprefix("task.params.")) for i, n in enumerate(names)]])
        else:
            # In the middle of the plot (x 0..1, y -0.6..0.6), whole: it needs two finished trials
            self.placeholder = pg.TextItem("after two\nfinished trials", color="#777", anchor=(0.5, 0.5))
            self.placeholder.setPos(0.5, 0.0)
            b.addItem(self.placeholder)
            b.getAxis("left").setTicks([[]])
        b.setXRange(0, 1, padding=0.02)
        b.setYRange(-0.6, max(1, len(names)) - 0.4, padding=0)
