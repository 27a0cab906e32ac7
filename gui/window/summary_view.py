"""The end-of-run summary above the plots: how the run ended, its training time and throughput, and
per value (train loss, validation loss, each metric) the final value, the best and the step of the best."""

from __future__ import annotations

import html
import math
from pathlib import Path

from multilane.engine.errors import UserError
from multilane.engine.rundir.runlog import METRICS, STATUS, iter_metrics, load_metrics, read_json
from multilane.gui.runs.run_summary import RunSummary, TrainingClock, fmt_duration, summarize_records
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QToolButton


def _num(v: float) -> str:
    if not math.isfinite(v):
        return "–"
    return f"{v:.3e}" if v != 0 and abs(v) < 1e-3 else f"{v:.4g}"


def summary_html(s: RunSummary, name: str) -> str:
    """The summary as a small rich-text table (also its tooltip-free text for tests)."""
    parts = [f"training time {fmt_duration(s.training_s)}"]
    if math.isfinite(s.samples_per_s):
        parts.append(f"{s.samples_per_s:,.0f} samples/s")
    # the short parts whole on a line: a narrow window wraps between them, never inside "samples/s"
    tail = "".join(" · " + p.replace(" ", "&nbsp;") for p in parts)
    head = f"<b>{html.escape(name)}</b> — {html.escape(s.stop_reason())}{tail}"
    rows = [
        "<tr><th align=left></th><th align=right>&nbsp;final&nbsp;</th>"
        "<th align=right>&nbsp;best&nbsp;</th><th align=right>&nbsp;at step&nbsp;</th></tr>"
    ]
    for series in s.series.values():
        if series.best_step is None:
            continue
        label = series.name.replace("_", " ") + (" ↑" if series.higher_better else "")
        rows.append(
            f"<tr><td>{html.escape(label)}</td><td align=right>&nbsp;{_num(series.final)}&nbsp;</td>"
            f"<td align=right>&nbsp;{_num(series.best)}&nbsp;</td><td align=right>&nbsp;{series.best_step:,}</td></tr>"
        )
    table = f"<table cellspacing=0>{''.join(rows)}</table>" if len(rows) > 1 else ""
    # each device's split at the last log, then will it fit: the forecast beside the measured peak
    memory = "".join(f"<br>{html.escape(line)}" for line in [*s.split, *s.memory])
    return head + table + memory


class SummaryView(QFrame):
    """Shown when a run ends (and when a past run is opened); the × hides it until the next one."""

    def __init__(self, parent=None) -> None:
        super().__init__(parent)
        self.setObjectName("summary")
        self.setFrameShape(QFrame.StyledPanel)
        self.summary: RunSummary | None = None
        self.label = QLabel()
        self.label.setObjectName("summary.text")
        self.label.setTextFormat(Qt.RichText)
        self.label.setTextInteractionFlags(Qt.TextSelectableByMouse)
        self.label.setWordWrap(True)
        close = QToolButton()
        close.setText("×")
        close.setAutoRaise(True)
        close.setToolTip("Hide the summary")
        close.clicked.connect(self.hide)
        lay = QHBoxLayout(self)
        lay.setContentsMargins(6, 2, 2, 2)
        lay.addWidget(self.label, 1)
        lay.addWidget(close, 0, Qt.AlignTop)
        self.hide()

    def show_run(self, run_dir: str | Path) -> bool:
        """Summarize the run folder (what it holds now); False (and hidden) when it holds nothing."""
        p = Path(run_dir)
        try:
            records = load_metrics(p).records
        except UserError:
            records = []
        if not records:
            self.hide()
            return False
        self.summary = summarize_records(records, read_json(p / STATUS))
        # every record, also those a resume superseded: the runs table's training time, to the second
        self.summary.training_s = TrainingClock.of(iter_metrics(p / METRICS)).seconds()
        self.label.setText(summary_html(self.summary, p.name))
        self.show()
        return True

    def show_records(self, records: list[dict], name: str) -> bool:
        """Summarize records that have no run folder (a TensorBoard logdir: no status, so no end state);
        False (and hidden) when there are none. Never the previous run's summary left standing."""
        if not records:
            self.hide()
            return False
        self.summary = summarize_records(records, None)
        self.summary.training_s = TrainingClock.of(records).seconds()
        self.label.setText(summary_html(self.summary, name))
        self.show()
        return True

    def text(self) -> str:
        """What it says, as plain text."""
        doc = self.label.text()
        from PySide6.QtGui import QTextDocument

        d = QTextDocument()
        d.setHtml(doc)
        return d.toPlainText().replace("\xa0", " ")
