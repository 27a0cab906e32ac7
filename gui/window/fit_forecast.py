"""Will it fit, before Start: ``multilane plan --json`` on the form's settings, in a child process (the
probe imports the task and allocates on the devices: never in the GUI thread, and no CUDA context left
in the app), its forecast shown in the device picker's "needs" column."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from multilane.engine.config import build_config
from multilane.engine.errors import UserError
from PySide6.QtCore import QObject, Signal
from PySide6.QtWidgets import QHBoxLayout, QLabel, QPushButton, QWidget

PLAN_TIMEOUT_S = 600


class _Answer(QObject):
    """Carries the plan's answer from its thread to the GUI thread (a queued signal)."""

    done = Signal(object)


class FitForecast(QWidget):
    """A "Will it fit?" button and one line of verdict; the numbers go to ``picker.show_needs``."""

    def __init__(self, picker: Any, config_dict: Callable[[], dict[str, Any]], on_host: Callable[[], bool]) -> None:
        super().__init__()
        self.picker, self.config_dict, self.on_host = picker, config_dict, on_host
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        self.button = QPushButton("Will it fit?")
        self.button.setObjectName("will_it_fit")
        self.button.setToolTip(
            "Measure the memory this run will need on each device: a probe step of its own model, batch, "
            "precision, strategy and optimizer at a few small batches (multilane plan)"
        )
        self.verdict = QLabel()
        self.verdict.setWordWrap(True)
        layout.addWidget(self.button)
        layout.addWidget(self.verdict, 1)
        self.button.clicked.connect(self.check)
        self._answer = _Answer()
        self._answer.done.connect(self._show)
        self._asked = 0  # the latest question's number: an older answer is not shown
        self.forecast: dict[str, Any] | None = None

    def clear(self) -> None:
        """The settings changed: the last forecast no longer applies."""
        self._asked += 1
        self.forecast = None
        self.picker.show_needs(None)
        self.verdict.setText("")
        self.button.setEnabled(True)

    def check(self) -> None:
        if self.on_host():
            self.verdict.setText("the forecast is for this computer's devices")
            return
        try:
            config = build_config(self.config_dict(), "settings")
        except UserError as e:
            self.verdict.setText(str(e))
            return
        self._asked += 1
        asked = self._asked
        self.button.setEnabled(False)
        self.verdict.setText("measuring a probe step…")
        threading.Thread(target=self._plan, args=(config.to_dict(), asked), daemon=True).start()

    def _plan(self, config: dict[str, Any], asked: int) -> None:
        """In its own thread: run ``multilane plan`` and hand its answer to the GUI thread."""
        with tempfile.TemporaryDirectory(prefix="multilane-plan-") as tmp:
            path = Path(tmp) / "config.json"
            path.write_text(json.dumps(config), encoding="utf-8")
            cmd = [sys.executable, "-m", "multilane.engine.cli", "plan", "--config", str(path), "--json"]
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=PLAN_TIMEOUT_S)
                out, err = r.stdout, r.stderr
            except (OSError, subprocess.TimeoutExpired) as e:
                out, err = "", f"multilane: error: the probe did not finish ({e})"
        forecast = None
        for line in reversed(out.splitlines()):
            if line.startswith("{"):
                forecast = json.loads(line)
                break
        errors = [x for x in err.splitlines() if x.startswith("multilane: error:")]
        message = errors[-1].removeprefix("multilane: error: ") if errors else None
        self._answer.done.emit({"asked": asked, "forecast": forecast, "message": message})

    def _show(self, answer: dict[str, Any]) -> None:
        if answer["asked"] != self._asked:
            return  # the settings changed while it measured
        self.button.setEnabled(True)
        self.forecast = answer["forecast"]
        self.picker.show_needs(self.forecast)
        if answer["message"]:
            # The CLI's hint (": --batch-size N") is the form's batch size field here.
            self.verdict.setText(f"⚠ {answer['message'].split(': --batch-size ')[0]}")
            self.verdict.setStyleSheet("color: #b00020;")
        elif self.forecast is not None:
            self.verdict.setText(f"fits at batch {self.forecast['batch']:,}")
            self.verdict.setStyleSheet("color: #1b6e20;")
