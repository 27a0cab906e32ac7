"""The export dialog: where, how wide and which formats, asked once."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtWidgets import (
    QCheckBox,
    QDialog,
    QDialogButtonBox,
    QFileDialog,
    QFormLayout,
    QHBoxLayout,
    QLineEdit,
    QPushButton,
    QSpinBox,
    QWidget,
)

FORMAT_NAMES = {"png": "PNG", "svg": "SVG", "pdf": "PDF", "csv": "CSV (every logged value)"}


class ExportDialog(QDialog):
    """Folder (starting in the run's own folder), PNG width and formats in one dialog."""

    def __init__(self, folder: str, width: int = 1600, bundle: bool = False, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Export bundle" if bundle else "Export figures and metrics")
        self.folder = QLineEdit(folder)
        self.folder.setMinimumWidth(380)
        browse = QPushButton("Browse…")
        browse.clicked.connect(self._browse)
        row = QHBoxLayout()
        row.addWidget(self.folder, 1)
        row.addWidget(browse)
        self.width = QSpinBox()
        self.width.setRange(200, 10000)
        self.width.setSingleStep(100)
        self.width.setSuffix(" px")
        self.width.setValue(width)
        self.width.setToolTip("Width of the PNGs; the SVG and PDF are vector, 7 in wide, with the same layout")
        self.formats = {k: QCheckBox(v) for k, v in FORMAT_NAMES.items()}
        boxes = QHBoxLayout()
        for box in self.formats.values():
            box.setChecked(True)
            boxes.addWidget(box)
        form = QFormLayout(self)
        form.addRow("Folder", row)
        form.addRow("PNG width", self.width)
        form.addRow("Formats", boxes)
        buttons = QDialogButtonBox(QDialogButtonBox.Ok | QDialogButtonBox.Cancel)
        buttons.button(QDialogButtonBox.Ok).setText("Export")
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        form.addRow(buttons)

    def _browse(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Export into", self.folder.text())
        if path:
            self.folder.setText(path)

    def chosen_formats(self) -> list[str]:
        return [k for k, box in self.formats.items() if box.isChecked()]

    def out_dir(self) -> str:
        return str(Path(self.folder.text()).expanduser())
