"""The Sweep tab's search space: one row a searched key (a numeric or choice field of the form, or of
the task's params), its kind and its range, written out as the CLI's ``--param`` specs."""

from __future__ import annotations

import typing
from typing import Any, Literal

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QComboBox,
    QHBoxLayout,
    QHeaderView,
    QLineEdit,
    QPushButton,
    QTableWidget,
    QVBoxLayout,
    QWidget,
)

KINDS = ("log", "float", "int", "choice")
DEFAULT_ROWS = [("optim.lr", "log", "1e-4:1e-1")]


def searchable_keys(task: str) -> list[str]:
    """Every numeric or choice field of the config's sections (not devices/run/telemetry) and of ``task``'s params."""
    from multilane.engine.config import RunConfig
    from multilane.engine.sweep.space import NOT_SWEPT

    keys = []
    for section, info in RunConfig.model_fields.items():
        if section in NOT_SWEPT or section == "task":
            continue
        for name, f in info.annotation.model_fields.items():
            if _searchable(f.annotation):
                keys.append(f"{section}.{name}")
    try:
        from multilane.engine.tasks.loader import task_class

        for name, f in task_class(task).Params.model_fields.items():
            if _searchable(f.annotation):
                keys.append(f"task.params.{name}")
    except Exception:  # a task file that does not load: its params are not offered (the form says why)
        pass
    return keys


def _searchable(annotation: Any) -> bool:
    if typing.get_origin(annotation) is Literal or annotation in (int, float, bool):
        return True
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return len(args) == 1 and args[0] in (int, float)


class SpaceEditor(QWidget):
    changed = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.table = QTableWidget(0, 3)
        self.table.setHorizontalHeaderLabels(["parameter", "kind", "range (LOW:HIGH or A,B,C)"])
        self.table.horizontalHeader().setSectionResizeMode(0, QHeaderView.Stretch)
        self.table.horizontalHeader().setSectionResizeMode(2, QHeaderView.Stretch)
        self.table.verticalHeader().setVisible(False)
        self.table.setMaximumHeight(130)
        add, remove = QPushButton("Add parameter"), QPushButton("Remove")
        add.clicked.connect(lambda: self.add_row("optim.weight_decay", "float", "0:0.1"))
        remove.clicked.connect(self.remove_selected)
        bar = QHBoxLayout()
        bar.addWidget(add)
        bar.addWidget(remove)
        bar.addStretch(1)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addWidget(self.table)
        lay.addLayout(bar)
        self._keys = searchable_keys("digits")
        for row in DEFAULT_ROWS:
            self.add_row(*row)

    def set_task(self, task: str) -> None:
        """The task changed in the form: offer its params."""
        self._keys = searchable_keys(task)
        for r in range(self.table.rowCount()):
            combo = self.table.cellWidget(r, 0)
            current = combo.currentText()
            combo.blockSignals(True)
            combo.clear()
            combo.addItems(self._keys)
            combo.setCurrentText(current)
            combo.blockSignals(False)

    def add_row(self, key: str, kind: str, text: str) -> None:
        r = self.table.rowCount()
        self.table.insertRow(r)
        keys = QComboBox()
        keys.setEditable(True)  # a task file's params appear once it loads; typing one works too
        keys.addItems(self._keys)
        keys.setCurrentText(key)
        kinds = QComboBox()
        kinds.addItems(KINDS)
        kinds.setCurrentText(kind)
        edit = QLineEdit(text)
        for w, sig in ((keys, keys.currentTextChanged), (kinds, kinds.currentTextChanged), (edit, edit.textChanged)):
            sig.connect(self.changed)
            self.table.setCellWidget(r, [keys, kinds, edit].index(w), w)
        self.changed.emit()

    def set_params(self, params: list[Any]) -> None:
        """The rows of a sweep's own params (engine.sweep.space.ParamSpec)."""
        self.table.setRowCount(0)
        for p in params:
            text = ",".join(map(str, p.choices)) if p.kind == "choice" else f"{p.low:g}:{p.high:g}"
            self.add_row(p.key, p.kind, text)

    def remove_selected(self) -> None:
        rows = sorted({i.row() for i in self.table.selectedIndexes()} or {self.table.currentRow()}, reverse=True)
        for r in rows:
            if r >= 0:
                self.table.removeRow(r)
        self.changed.emit()

    def specs(self) -> list[str]:
        """The rows as ``--param`` specs."""
        out = []
        for r in range(self.table.rowCount()):
            key = self.table.cellWidget(r, 0).currentText().strip()
            kind = self.table.cellWidget(r, 1).currentText()
            text = self.table.cellWidget(r, 2).text().strip()
            out.append(f"{key}={kind}:{text}")
        return out
