"""The runs table: past runs of the runs folder, sortable, to open or compare."""

from __future__ import annotations

import math
from pathlib import Path

from multilane.engine.numbers import format_number
from multilane.gui.window.runs_index import COLUMNS, RunSummary, list_runs
from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QAbstractItemView,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)


class _Item(QTableWidgetItem):
    """A cell that sorts by its value (numbers as numbers, blanks last), not by its text."""

    def __init__(self, text: str, key: float | str) -> None:
        super().__init__(text)
        self.key = key

    def __lt__(self, other: QTableWidgetItem) -> bool:
        a, b = self.key, getattr(other, "key", other.text())
        if isinstance(a, float) and isinstance(b, float):
            return (math.isnan(a), a) < (math.isnan(b), b)
        return str(a) < str(b)


def _cell(row: RunSummary, key: str) -> _Item:
    v = row.value(key)
    if isinstance(v, float):
        if math.isnan(v):
            text = ""
        elif key == "lr":
            text = f"{v:g}"
        elif key in ("batch",):
            text = f"{v:.0f}"
        elif key == "duration_s":
            text = f"{v:,.1f}"
        else:
            text = format_number(v)
        if key == "final_metric" and text:
            text = f"{row.metric_name} {text}"
        return _Item(text, v)
    return _Item(str(v), str(v))


class RunsTable(QWidget):
    """Runs in a folder with their status, key hyperparameters, final and best metrics and duration."""

    openRequested = Signal(str)
    compareRequested = Signal(list)  # run folders: the first is shown, the others compared with it

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.runs_dir = ""
        self.rows: list[RunSummary] = []
        self.folder = QLabel()
        self.folder.setWordWrap(True)
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels([title for _, title in COLUMNS])
        self.table.setSelectionBehavior(QAbstractItemView.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.ExtendedSelection)
        self.table.setEditTriggers(QAbstractItemView.NoEditTriggers)
        self.table.setSortingEnabled(True)
        self.table.verticalHeader().setVisible(False)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeToContents)
        self.table.doubleClicked.connect(lambda _index: self._open())
        self.open_btn = QPushButton("Open")
        self.compare_btn = QPushButton("Compare selected")
        self.compare_btn.setToolTip("Select two or more runs (Ctrl+click); the first selected is shown")
        refresh = QPushButton("Refresh")
        self.open_btn.clicked.connect(self._open)
        self.compare_btn.clicked.connect(self._compare)
        refresh.clicked.connect(lambda: self.load(self.runs_dir))
        self.table.itemSelectionChanged.connect(self._selection_changed)
        buttons = QHBoxLayout()
        for b in (self.open_btn, self.compare_btn, refresh):
            buttons.addWidget(b)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.folder)
        layout.addWidget(self.table, 1)
        layout.addLayout(buttons)
        self._selection_changed()

    def load(self, runs_dir: str) -> None:
        """(Re)read every run folder under ``runs_dir``."""
        self.runs_dir = runs_dir
        self.rows = list_runs(runs_dir)
        self.folder.setText(f"{len(self.rows)} runs in {runs_dir}" if self.rows else f"No runs in {runs_dir} yet")
        self.table.setSortingEnabled(False)
        self.table.setRowCount(len(self.rows))
        for r, row in enumerate(self.rows):
            for c, (key, _) in enumerate(COLUMNS):
                item = _cell(row, key)
                item.setData(Qt.UserRole, str(row.path))
                if row.notes:
                    item.setToolTip("; ".join(row.notes))
                self.table.setItem(r, c, item)
        self.table.setSortingEnabled(True)
        self._selection_changed()

    def selected_paths(self) -> list[str]:
        rows = sorted({i.row() for i in self.table.selectedIndexes()})
        return [self.table.item(r, 0).data(Qt.UserRole) for r in rows]

    def select(self, paths: list[str]) -> None:
        """Select the rows of these run folders (as a user's Ctrl+click would)."""
        self.table.clearSelection()
        wanted = {str(Path(p)) for p in paths}
        mode = self.table.selectionMode()
        self.table.setSelectionMode(QAbstractItemView.MultiSelection)
        for r in range(self.table.rowCount()):
            if self.table.item(r, 0).data(Qt.UserRole) in wanted:
                self.table.selectRow(r)
        self.table.setSelectionMode(mode)

    def _selection_changed(self) -> None:
        n = len(self.selected_paths())
        self.open_btn.setEnabled(n == 1)
        self.compare_btn.setEnabled(n >= 2)

    def _open(self) -> None:
        paths = self.selected_paths()
        if paths:
            self.openRequested.emit(paths[0])

    def _compare(self) -> None:
        paths = self.selected_paths()
        if len(paths) >= 2:
            self.compareRequested.emit(paths)
