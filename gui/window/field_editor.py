"""One form field: the widget that a config schema field's type calls for (bool → checkbox, Literal →
combo box, int → spin box with the schema's bounds, float/str → line edit, a list of strings → a line edit
of comma-separated items (or the field's own ``separator``: prompts hold commas), a path → a line edit with a file or folder picker, ``"path"``: either, from a
menu; on a list the picked path is added), its value read back, and its mark when the value breaks a rule."""

from __future__ import annotations

import typing
from typing import Any, Literal

from pydantic.fields import FieldInfo
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QFileDialog,
    QHBoxLayout,
    QLineEdit,
    QMenu,
    QSpinBox,
    QToolButton,
    QWidget,
)

INVALID_STYLE = "border: 1px solid #d62728; background: #fff0f0;"


def _bounds(field: FieldInfo) -> tuple[float | None, float | None]:
    lo = hi = None
    for m in field.metadata:
        lo = getattr(m, "ge", None) if getattr(m, "ge", None) is not None else lo
        if getattr(m, "gt", None) is not None:
            lo = m.gt
        hi = getattr(m, "le", None) if getattr(m, "le", None) is not None else hi
        if getattr(m, "lt", None) is not None:
            hi = m.lt
    return lo, hi


def _extra(field: FieldInfo) -> dict[str, Any]:
    extra = field.json_schema_extra
    return extra if isinstance(extra, dict) else {}


def _with_picker(line: QLineEdit, kind: str, many: bool = False) -> QWidget:
    """A path field: the line edit and a "…" button opening a file (or folder) dialog; ``kind`` "path":
    a menu of both. ``many`` (a list field): the chosen path is added to the list, not put in its place."""
    row = QWidget()
    lay = QHBoxLayout(row)
    lay.setContentsMargins(0, 0, 0, 0)
    lay.addWidget(line, 1)
    button = QToolButton()
    button.setText("…")
    button.setObjectName(f"{line.objectName()}.browse")
    button.setToolTip("Choose a file or a folder" if kind == "path" else f"Choose a {kind}")
    start = "" if many else line.text()

    def browse(what: str) -> None:
        if what == "folder":
            path = QFileDialog.getExistingDirectory(row, "Choose a folder", start)
        else:
            path, _ = QFileDialog.getOpenFileName(row, "Choose a file", start)
        if path:
            line.setText(f"{line.text().rstrip(', ')}, {path}" if many and line.text().strip() else path)

    if kind == "path":
        menu = QMenu(button)
        menu.addAction("File…", lambda: browse("file"))
        menu.addAction("Folder…", lambda: browse("folder"))
        button.setMenu(menu)
        button.setPopupMode(QToolButton.InstantPopup)
    else:
        button.clicked.connect(lambda: browse(kind))
    lay.addWidget(button)
    return row


class FieldEditor:
    """One widget bound to one schema field."""

    def __init__(self, key: str, field: FieldInfo, on_change) -> None:
        self.key = key
        ann = field.annotation
        args = typing.get_args(ann)
        self.optional = type(None) in args
        base = next((a for a in args if a is not type(None)), ann) if self.optional else ann
        self.kind = "str"
        self.separator = str(_extra(field).get("separator", ","))
        if base is bool:
            self.kind, w = "bool", QCheckBox()
            w.toggled.connect(on_change)
        elif typing.get_origin(base) is Literal:
            self.kind, w = "choice", QComboBox()
            w.addItems([str(a) for a in typing.get_args(base)])
            w.currentTextChanged.connect(on_change)
        elif base is int:
            self.kind, w = "int", QSpinBox()
            lo, hi = _bounds(field)
            lo = int(lo) if lo is not None else 0
            w.setRange(lo - 1 if self.optional else lo, int(min(hi if hi is not None else 2**31 - 1, 2**31 - 1)))
            if self.optional:
                w.setSpecialValueText(str(_extra(field).get("none_text", "off")))
            w.setAccelerated(True)
            w.valueChanged.connect(on_change)
        else:
            many = typing.get_origin(base) is list and typing.get_args(base) in ((str,), ())
            self.kind = "float" if base is float else "list" if many else "str"
            w = QLineEdit()
            w.textChanged.connect(on_change)
        w.setToolTip(field.description or "")
        w.setObjectName(key)
        self.widget = w
        self.description = field.description or ""
        self.row: QWidget = w
        picker = _extra(field).get("picker")
        if picker in ("file", "folder", "path") and isinstance(w, QLineEdit):
            self.row = _with_picker(w, picker, self.kind == "list")

    def set(self, value: Any) -> None:
        w = self.widget
        if self.kind == "bool":
            w.setChecked(bool(value))
        elif self.kind == "choice":
            w.setCurrentText(str(value))
        elif self.kind == "int":
            w.setValue(w.minimum() if value is None else int(value))
        elif self.kind == "list" and isinstance(value, (list, tuple)):
            w.setText((", " if self.separator == "," else f" {self.separator} ").join(str(v) for v in value))
        else:
            w.setText("" if value is None else (f"{value:g}" if isinstance(value, float) else str(value)))

    def get(self) -> Any:
        w = self.widget
        if self.kind == "bool":
            return w.isChecked()
        if self.kind == "choice":
            return w.currentText()
        if self.kind == "int":
            return None if self.optional and w.value() == w.minimum() else w.value()
        text = w.text().strip()
        if self.kind == "list":  # comma-separated items
            return [item.strip() for item in text.split(self.separator) if item.strip()]
        if self.kind == "float":
            try:
                return float(text)
            except ValueError:
                return text  # the schema names the problem
        return text

    def mark(self, message: str | None) -> None:
        self.widget.setStyleSheet(INVALID_STYLE if message else "")
        self.widget.setToolTip(f"{message}\n\n{self.description}" if message else self.description)
