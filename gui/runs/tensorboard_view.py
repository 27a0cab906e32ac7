"""A TensorBoard logdir in the window (File → Open TensorBoard logdir): its scalars in the same plots,
updated while something still writes it.

The logdir is read with TensorBoard's own loader (``multilane.integrations.tensorboard``): each poll
reads only what was appended since the last, a torn last record waits for the next poll, and nothing
is ever written into the logdir. Polling stops once the plots show something else.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from multilane.gui.runs.run_data import RunData
from PySide6.QtCore import QObject, QTimer

POLL_MS = 1000


class TensorBoardView(QObject):
    """Feeds one logdir's records into ``plots`` (a ``PlotPanel``) until it shows another run."""

    def __init__(self, logdir: Any, plots: Any, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.logdir = logdir
        self.plots = plots
        self.data = RunData(Path(logdir.path).name)
        self.records = logdir.read()  # what the summary box sums up
        self.data.extend(self.records)
        self.timer = QTimer(self)
        self.timer.setInterval(POLL_MS)
        self.timer.timeout.connect(self.poll)

    def show(self) -> None:
        self.plots.reset(self.data)
        self.timer.start()

    def poll(self) -> int:
        """Read what was appended; the number of records added."""
        if self.plots.data is not self.data:  # the window moved on to another run
            self.timer.stop()
            return 0
        records = self.logdir.read()
        for rec in records:
            self.plots.add_record(rec)
        if records:
            self.plots.refresh()
        return len(records)

    def stop(self) -> None:
        self.timer.stop()
