"""Table cells that sort by value: ``SortItem`` (numbers as numbers, NaN and blanks last), which the runs
table and the sweep's trials table both use, and ``run_cell``, a run's cell in the runs table."""

from __future__ import annotations

import math

from multilane.engine.numbers import format_number
from multilane.gui.runs.run_summary import fmt_duration
from multilane.gui.table.runs_index import RunSummary
from PySide6.QtWidgets import QTableWidgetItem


class SortItem(QTableWidgetItem):
    """A cell that sorts by its value (numbers as numbers, blanks last), not by its text."""

    def __init__(self, text: str, key: float | str) -> None:
        super().__init__(text)
        self.key = key

    def __lt__(self, other: QTableWidgetItem) -> bool:
        a, b = self.key, getattr(other, "key", other.text())
        if isinstance(a, float) and isinstance(b, float):
            return (math.isnan(a), a) < (math.isnan(b), b)
        return str(a) < str(b)


def run_cell(row: RunSummary, key: str) -> SortItem:
    """The runs table's cell of ``row`` under column ``key``: its text as people read it, sorting by value."""
    v = row.value(key)
    if key == "steps":
        return SortItem(str(v), row.step)
    if isinstance(v, float):
        if math.isnan(v):
            text = ""
        elif key == "lr":
            text = f"{v:g}"
        elif key in ("batch",):
            text = f"{v:.0f}"
        elif key == "tokens_per_s":
            text = f"{v:,.0f}"
        elif key == "duration_s":
            text = fmt_duration(v)
        else:
            text = format_number(v)
        if key == "final_metric" and text:
            text = f"{row.metric_name} {text}"
        return SortItem(text, v)
    return SortItem(str(v), str(v))
