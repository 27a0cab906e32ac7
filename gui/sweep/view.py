"""The sweep's side of the window while the Sweep tab is open: the live trials table (sortable, the best
bold with ★, a lost or failed trial's reason in its tooltip), the trial actions (Show curves, Stop trial,
Prune trial) and Export…, then the parallel coordinates and importances. The selected trials' curves
appear under it, in the window's own run plots (the tab shows them once trials are selected)."""

from __future__ import annotations

import math
from typing import Any

from multilane.gui.sweep.live_plots import SweepPlots
from multilane.gui.table.cells import SortItem
from PySide6.QtCore import Qt
from PySide6.QtGui import QFont
from PySide6.QtWidgets import (
    QAbstractItemView,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QSplitter,
    QTableWidget,
    QVBoxLayout,
    QWidget,
)

NO_SWEEP = "<b>Trials</b> &nbsp; no sweep yet: Start sweep, or Open sweep… to follow one"
HINT = "Select trials in the table to see their curves below (several: compared)."


class SweepView(QWidget):
    def __init__(self) -> None:
        super().__init__()
        self.setObjectName("sweep_view")
        self.title = QLabel(NO_SWEEP)
        self.table = QTableWidget(0, 0)
        self.table.setObjectName("sweep_trials")
        self.table.setSortingEnabled(True)
        self.table.setSelectionBehavior(QAbstractItemView.SelectRows)
        self.table.setEditTriggers(QAbstractItemView.NoEditTriggers)
        self.table.verticalHeader().setVisible(False)
        self.show_btn = QPushButton("Show curves")
        self.stop_trial_btn = QPushButton("Stop trial")
        self.stop_trial_btn.setToolTip("Stop the selected running trials (recorded failed: stopped by hand)")
        self.prune_btn = QPushButton("Prune trial")
        self.prune_btn.setToolTip("Prune the selected running trials (recorded pruned)")
        self.export_btn = QPushButton("Export…")
        self.export_btn.setToolTip("The trials table as CSV and the sweep figures as PNG/SVG/PDF")
        self.hint = QLabel(HINT)
        self.hint.setStyleSheet("color: #555;")
        bar = QHBoxLayout()
        for b in (self.show_btn, self.stop_trial_btn, self.prune_btn):
            bar.addWidget(b)
        bar.addWidget(self.hint, 1)
        bar.addWidget(self.export_btn)
        self.plots = SweepPlots()

        top = QWidget()
        tv = QVBoxLayout(top)
        tv.setContentsMargins(0, 0, 0, 0)
        tv.addWidget(self.title)
        tv.addWidget(self.table, 1)
        tv.addLayout(bar)
        self.split = QSplitter(Qt.Vertical)
        self.split.addWidget(top)
        self.split.addWidget(self.plots)
        self.split.setChildrenCollapsible(False)
        self.split.setSizes([300, 230])
        lay = QVBoxLayout(self)
        lay.setContentsMargins(4, 6, 6, 0)
        lay.addWidget(self.split)

    # -- the table -------------------------------------------------------------------------------------
    def fill(self, rows: list[dict[str, Any]], spec: Any) -> None:
        """The trials as ``trial_rows`` gives them; the selection (by trial number) kept."""
        self.title.setText("<b>Trials</b>")
        keys = [p.key for p in spec.params]
        headers = ["#", "state", *(k.removeprefix("task.params.") for k in keys), spec.objective, "best so far",
                   "step", "duration (s)", "devices", "host"]  # fmt: skip
        selected = set(self.selected_numbers())
        t = self.table
        t.setSortingEnabled(False)
        t.setColumnCount(len(headers))
        t.setHorizontalHeaderLabels(headers)
        t.setRowCount(len(rows))
        bold = QFont()
        bold.setBold(True)
        for i, r in enumerate(rows):
            cells = [
                SortItem(f"{r['number']}{' ★' if r['is_best'] else ''}", float(r["number"])),
                SortItem(r["state"], r["state"]),
            ]
            cells += [_value_item(r["params"].get(k)) for k in keys]
            cells += [_value_item(r["value"]), _value_item(r["best"]), _value_item(r["step"])]
            cells += [
                _value_item(None if r["duration_s"] is None else round(r["duration_s"], 1)),
                SortItem(r["devices"], r["devices"]),
                SortItem(r["host"], r["host"]),
            ]
            for j, cell in enumerate(cells):
                if r["is_best"]:
                    cell.setFont(bold)
                if r["error"]:
                    cell.setToolTip(r["error"])
                t.setItem(i, j, cell)
        t.setSortingEnabled(True)
        t.blockSignals(True)
        for i in range(t.rowCount()):
            if self.number_at(i) in selected:
                t.selectRow(i)
        t.blockSignals(False)

    def number_at(self, row: int) -> int | None:
        item = self.table.item(row, 0)
        return int(item.key) if item is not None else None

    def selected_numbers(self) -> list[int]:
        rows = sorted({i.row() for i in self.table.selectedIndexes()})
        return [n for n in (self.number_at(r) for r in rows) if n is not None]


def _value_item(v: Any) -> SortItem:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return SortItem("", float("nan"))
    if isinstance(v, (bool, str)):
        return SortItem(str(v), str(v))
    return SortItem(f"{v:.4g}" if isinstance(v, float) else str(v), float(v))
