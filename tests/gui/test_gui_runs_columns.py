"""The Runs table as drawn at 1280×800: the columns that decide a comparison (strategy, devices, batch, lr,
the final and best losses) in view without scrolling, the rest one right-click away and remembered. Runs
are real run folders made by the engine (replicate, ddp and fsdp on two CPU lanes, as records on disk)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("PySide6")

from multilane.gui.table.runs_index import COLUMNS, MAIN_COLUMNS


def fake_finished_run(runs, name: str, strategy: str) -> None:
    """A finished run's folder as the engine leaves it (config, status, records): what the table reads."""
    run = runs / name
    run.mkdir(parents=True)
    config = {
        "task": {"name": "digits"},
        "devices": {"use": "cpu:0,cpu:1", "strategy": strategy},
        "data": {"batch_size": 64},
        "optim": {"name": "adam", "lr": 0.003},
    }
    (run / "config.json").write_text(json.dumps(config))
    (run / "status.json").write_text(json.dumps({"state": "finished", "step": 60, "total_steps": 60}))
    records = [
        {"kind": "event", "event": "started", "step": 0, "wall_time": 1000.0},
        {"kind": "train", "step": 60, "wall_time": 1002.0, "loss": 0.3369},
        {"kind": "eval", "step": 60, "wall_time": 1002.1, "val_loss": 0.2479, "metrics": {}},
        {"kind": "event", "event": "finished", "step": 60, "wall_time": 1002.2},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def shown_whole(table) -> dict[str, bool]:
    right = table.viewport().width()
    return {
        key: table.columnViewportPosition(c) + table.columnWidth(c) <= right
        for c, (key, _) in enumerate(COLUMNS)
        if not table.isColumnHidden(c)
    }


def test_at_1280_px_the_columns_that_decide_a_comparison_are_in_view(qtbot, make_window, tmp_path):
    w = make_window()
    runs = tmp_path / "runs"
    for strategy in ("replicate", "ddp", "fsdp"):
        fake_finished_run(runs, f"20261204-231738-a-long-run-name-{strategy}", strategy)
    w.resize(1280, 800)
    w.show()
    qtbot.waitExposed(w)
    w.tabs.setCurrentWidget(w.runs_table)
    table = w.runs_table.table
    qtbot.waitUntil(lambda: table.rowCount() == 3)
    qtbot.wait(50)
    whole = shown_whole(table)
    assert set(whole) == set(MAIN_COLUMNS), whole
    assert all(whole.values()), whole
    headers = [table.horizontalHeaderItem(c).text() for c in range(table.columnCount())]
    strategies = {table.item(r, headers.index("strategy")).text() for r in range(3)}
    assert strategies == {"replicate", "ddp", "fsdp"}
    # a hidden column comes back on demand, and the window remembers the choice
    w.runs_table.set_hidden_columns(["note"])
    assert not table.isColumnHidden(headers.index("training time"))
    w.close()
    again = make_window()
    again.resize(1280, 800)
    assert again.runs_table.hidden_columns() == ["note"]
