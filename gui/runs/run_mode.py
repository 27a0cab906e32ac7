"""Setup → Parallel strategy → "separate process": where the app trains a run.

Checked (the default), the run trains in a child process (``multilane train``) that the window
follows through the run folder; unchecked, in the app's own worker thread. ddp always runs as child
processes (one per device), so for ddp the box is ticked and locked. The choice is remembered
(QSettings ``separate_process``). docs/performance.md measures both; docs/app.md says why the default.
"""

from __future__ import annotations

from multilane.engine.config import PROCESS_STRATEGIES
from PySide6.QtCore import QSettings
from PySide6.QtWidgets import QCheckBox, QComboBox

DEFAULT = True
TIP = (
    "Train in a child process (multilane train) that the window follows through the run folder: the "
    "window never slows training, and the run can outlive the app. Unticked, training runs in the app's "
    "own thread (it starts a second or two sooner, but shares Python's GIL with the window)."
)
DDP_TIP = "ddp and fsdp run one process per device: they always run outside the app"


class SeparateProcessOption(QCheckBox):
    """The choice, with the strategy combo box it depends on."""

    def __init__(self, settings: QSettings, strategy: QComboBox) -> None:
        super().__init__("run in a separate process")
        self.setObjectName("run.separate_process")
        self.settings = settings
        self.strategy = strategy
        self.wanted = settings.value("separate_process", DEFAULT, type=bool)  # the user's own choice
        self.setChecked(self.wanted)
        self.toggled.connect(self._toggled)
        strategy.currentTextChanged.connect(self.follow_strategy)
        self.follow_strategy(strategy.currentText())

    def _toggled(self, on: bool) -> None:
        if self.isEnabled():  # a user's click, not ddp forcing it on
            self.wanted = on
            self.settings.setValue("separate_process", on)

    def follow_strategy(self, strategy: str) -> None:
        ddp = strategy in PROCESS_STRATEGIES
        self.setEnabled(not ddp)
        self.setChecked(True if ddp else self.wanted)
        self.setToolTip(DDP_TIP if ddp else TIP)
