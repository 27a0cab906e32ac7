"""The Runs table's "Send to MLflow…": the selected runs sent to a tracking server by ``multilane export RUN
--mlflow URI``, one process after another (QProcess), so that the window never waits for the server; the
table's message line says how each went. The same run sent again updates the same MLflow run."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from PySide6.QtCore import QObject, QProcess, Signal
from PySide6.QtWidgets import QInputDialog, QPushButton

if TYPE_CHECKING:
    from multilane.gui.table.runs_table import RunsTable


class MlflowSend(QObject):
    """The button, the URI dialog and the queue of runs being sent."""

    finished = Signal(list)  # one line per run sent (or refused), when the queue is done

    def __init__(self, table: RunsTable) -> None:
        super().__init__(table)
        self.table = table
        self.button = QPushButton("Send to MLflow…")
        self.button.setObjectName("runs.mlflow")
        self.button.setToolTip(
            "Send the selected runs to an MLflow tracking server (multilane export RUN --mlflow URI): the same "
            "MLflow run on every send, only what it lacks. Credentials: MLFLOW_TRACKING_USERNAME/PASSWORD/TOKEN"
        )
        self.button.clicked.connect(self.ask)
        table.table.itemSelectionChanged.connect(self._enable)
        self._queue: list[str] = []
        self._uri = self._last = ""
        self._lines: list[str] = []
        self.proc: QProcess | None = None
        self._enable()

    def _enable(self) -> None:
        self.button.setEnabled(bool(self.table.selected_paths()) and self.proc is None)

    def ask(self) -> None:
        uri, ok = QInputDialog.getText(self.table, "Send to MLflow", "Tracking server URI:", text=self._last)
        if ok and uri.strip():
            self.send(self.table.selected_paths(), uri.strip())

    def send(self, paths: list[str], uri: str) -> None:
        """Send ``paths`` to ``uri``, one after another; ``finished`` says how each went."""
        if self.proc is not None or not paths:
            return
        if "@" not in uri.split("://", 1)[-1].split("/", 1)[0]:  # offered next time; never one with a password
            self._last = uri
        self._queue, self._uri, self._lines = list(paths), uri, []
        self._next()

    def _next(self) -> None:
        if not self._queue:
            self.proc = None
            self._enable()
            failed = any("multilane: error" in line for line in self._lines)
            self.table.say(" · ".join(self._lines), error=failed)
            self.finished.emit(list(self._lines))
            return
        path = self._queue.pop(0)
        self.table.say(f"sending {path} to MLflow…")
        proc = self.proc = QProcess(self)
        proc.setProgram(sys.executable)
        proc.setArguments(["-m", "multilane.engine.cli", "export", path, "--mlflow", self._uri])
        proc.finished.connect(lambda *_: self._done(proc))
        self._enable()
        proc.start()

    def _done(self, proc: QProcess) -> None:
        out = bytes(proc.readAllStandardOutput()).decode(errors="replace").strip().splitlines()
        err = bytes(proc.readAllStandardError()).decode(errors="replace").strip().splitlines()
        said = [line for line in err if line.startswith("multilane: error")] or out[-1:] or err[-1:]
        line = said[0] if said else f"export ended with exit {proc.exitCode()}"
        self._lines.append(f"{Path(proc.arguments()[3]).name}: {line}")
        proc.deleteLater()
        self._next()
