"""The runs table as a user works in it: search and filter, sort on every column, tags and a note,
rename, delete to the trash with undo, and a table that refreshes by itself as runs start and end."""

import json
import math
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("PySide6")

from helpers import start_long_cli_run
from multilane.engine.run.trainer import Trainer
from multilane.engine.rundir.control_file import write_control
from multilane.engine.rundir.runs_folder import META, TRASH
from multilane.gui.table.runs_index import COLUMNS
from PySide6.QtCore import Qt


@pytest.fixture
def runs(make_config):
    """Three real runs: 120 steps named alpha, beta (stopped at step 0 of 120), 30 steps named gamma."""
    out = {}
    for name, steps in (("alpha", 120), ("beta", 120), ("gamma", 30)):
        cfg = make_config(train__steps=steps, run__name=name, data__batch_size=16)
        trainer = Trainer(cfg)
        if name == "beta":
            trainer.control.request_stop()  # stopped before its first step: a "stopped" run
        out[name] = trainer.run().run_dir
    return out


def col(key: str) -> int:
    return [k for k, _ in COLUMNS].index(key)


def shown(table) -> list[str]:
    return [Path(p).name.split("-")[-1] for p in table.visible_paths()]


@pytest.mark.slow
def test_search_and_the_state_filter_narrow_the_table(qtbot, window, runs):
    window.tabs.setCurrentWidget(window.runs_table)
    t = window.runs_table
    assert sorted(shown(t)) == ["alpha", "beta", "gamma"]
    t.search.setText("gam")
    assert shown(t) == ["gamma"]
    t.search.setText("linear alpha")  # every word must match, in any column
    assert shown(t) == []
    t.search.setText("alpha")
    assert shown(t) == ["alpha"]
    t.search.clear()
    t.state.setCurrentText("stopped")
    assert shown(t) == ["beta"]
    t.state.setCurrentText("all")
    assert len(shown(t)) == 3


def test_every_column_sorts_by_its_value(qtbot, window, runs):
    window.tabs.setCurrentWidget(window.runs_table)
    t = window.runs_table
    table = t.table
    for c, (key, _) in enumerate(COLUMNS):
        table.sortItems(c, Qt.AscendingOrder)
        keys = [table.item(r, c).key for r in range(table.rowCount())]
        nums = [k for k in keys if isinstance(k, float)]
        if len(nums) == len(keys):  # numbers as numbers, blanks (NaN) last
            finite = [k for k in keys if not math.isnan(k)]
            assert finite == sorted(finite) and keys[: len(finite)] == finite, (key, keys)
        else:
            assert keys == sorted(keys, key=str), (key, keys)
    table.sortItems(col("steps"), Qt.DescendingOrder)  # by the number: "120/120" above "30/30" (text: below)
    assert [table.item(r, col("steps")).text() for r in range(3)] == ["120/120", "30/30", "0/120"]


@pytest.mark.slow
def test_tags_and_a_note_are_kept_in_the_run_folder_and_searchable(qtbot, window, runs):
    window.tabs.setCurrentWidget(window.runs_table)
    t = window.runs_table
    (row,) = [r for r in range(t.table.rowCount()) if t.table.item(r, 0).data(Qt.UserRole) == str(runs["alpha"])]
    assert t.table.item(row, col("tags")).flags() & Qt.ItemIsEditable
    assert not t.table.item(row, col("lr")).flags() & Qt.ItemIsEditable
    t.table.item(row, col("tags")).setText("baseline, small")  # what an edit of the cell commits
    assert json.loads((runs["alpha"] / META).read_text())["tags"] == ["baseline", "small"]
    t.set_meta(str(runs["gamma"]), note="lr too high?")
    assert json.loads((runs["gamma"] / META).read_text())["note"] == "lr too high?"
    t.load(t.runs_dir)
    t.search.setText("baseline")
    assert shown(t) == ["alpha"]
    t.search.setText("too high")
    assert shown(t) == ["gamma"]


@pytest.mark.slow
def test_rename_and_delete_to_the_trash_with_undo(qtbot, window, runs):
    window.tabs.setCurrentWidget(window.runs_table)
    t = window.runs_table
    new = t.rename(str(runs["alpha"]), "alpha-baseline")
    assert new == str(runs["alpha"].parent / "alpha-baseline") and Path(new, "metrics.jsonl").exists()
    assert "alpha-baseline" in [Path(p).name for p in t.visible_paths()]
    assert t.rename(new, runs["gamma"].name) is None and "already exists" in t.message.text()
    t.select([new, str(runs["gamma"])])
    qtbot.mouseClick(t.delete_btn, Qt.LeftButton)
    assert not Path(new).exists() and not runs["gamma"].exists()
    trash = runs["gamma"].parent / TRASH
    assert sorted(p.name for p in trash.iterdir()) == sorted(["alpha-baseline", runs["gamma"].name])
    assert len(t.visible_paths()) == 1 and "to the trash" in t.message.text()
    assert t.undo_btn.isEnabled()
    qtbot.mouseClick(t.undo_btn, Qt.LeftButton)
    assert Path(new, "metrics.jsonl").exists() and (runs["gamma"] / "metrics.jsonl").exists()
    assert len(t.visible_paths()) == 3 and not list(trash.iterdir())


@pytest.mark.slow
def test_the_table_refreshes_by_itself_as_runs_start_and_end_and_a_live_run_is_not_deleted(
    qtbot, window, runs, tmp_path
):
    window.show()
    window.tabs.setCurrentWidget(window.runs_table)
    t = window.runs_table
    assert len(t.rows) == 3
    proc = start_long_cli_run(tmp_path / "runs", "train.log_every=5", "train.eval_every=0", stderr=subprocess.DEVNULL)
    try:
        qtbot.waitUntil(lambda: len(t.rows) == 4, timeout=90_000)  # no Refresh pressed
        (live,) = [r for r in t.rows if r.path not in runs.values()]
        qtbot.waitUntil(lambda: any(r.status == "running" for r in t.rows), timeout=90_000)
        assert t.delete([str(live.path)]) == 0 and "in use by pid" in t.message.text()
        assert live.path.is_dir()
        write_control(live.path, "stop")
        assert proc.wait(timeout=90) == 0
        qtbot.waitUntil(lambda: [r.status for r in t.rows if r.path == live.path] == ["stopped"], timeout=30_000)
    finally:
        proc.kill()
        proc.wait(timeout=60)


@pytest.mark.slow
def test_a_run_that_diverged_shows_as_diverged_not_stopped(qtbot, tmp_path):
    # A real run whose loss went NaN (and one stopped by the user beside it): the status column says
    # "diverged", and the state filter tells the two apart.
    from helpers import DIVERGE_TASK, diverge_settings
    from multilane.engine.config import build_config
    from multilane.engine.tasks import make_task
    from multilane.gui.table.runs_table import RunsTable

    runs = tmp_path / "runs"
    cfg = diverge_settings(runs, "cpu:0", "replicate", 3, steps=6)
    assert Trainer(build_config(cfg), task=make_task(DIVERGE_TASK, cfg["task"]["params"])).run().status == "diverged"
    cfg = diverge_settings(runs, "cpu:0", "replicate", 0, steps=6) | {"run": {"runs_dir": str(runs), "name": "user"}}
    stopped = Trainer(build_config(cfg), task=make_task(DIVERGE_TASK, cfg["task"]["params"]))
    stopped.control.request_stop()
    assert stopped.run().status == "stopped"
    t = RunsTable()
    qtbot.addWidget(t)
    t.load(str(runs))
    statuses = sorted(t.table.item(r, col("status")).text() for r in range(t.table.rowCount()))
    assert statuses == ["diverged", "stopped"]
    t.state.setCurrentText("diverged")
    assert shown(t) == ["run"]
    t.state.setCurrentText("stopped")
    assert shown(t) == ["user"]
