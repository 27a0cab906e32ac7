"""A runs folder as a user keeps it: tags and notes on runs, renaming, deleting to the trash and back."""

import json
import subprocess
import time

import pytest
from helpers import start_long_cli_run
from multilane.engine.errors import UserError
from multilane.engine.run.trainer import Trainer
from multilane.engine.rundir.runs_folder import (
    META,
    TRASH,
    parse_tags,
    read_meta,
    rename_run,
    restore_run,
    run_folder_problem,
    trash_run,
    write_meta,
)


@pytest.fixture
def run_dir(make_config):
    return Trainer(make_config(train__steps=3)).run().run_dir


def test_tags_and_note_live_in_the_run_folder_and_survive_a_bad_meta_file(run_dir):
    assert read_meta(run_dir) == {"tags": [], "note": ""}
    write_meta(run_dir, tags=parse_tags("baseline, lr  baseline"), note="first try")
    assert json.loads((run_dir / META).read_text()) == {"tags": ["baseline", "lr"], "note": "first try"}
    write_meta(run_dir, note="second look")  # tags stay
    assert read_meta(run_dir) == {"tags": ["baseline", "lr"], "note": "second look"}
    (run_dir / META).write_text("[1, 2")  # torn by hand: read as no tags, never an error
    assert read_meta(run_dir) == {"tags": [], "note": ""}


def test_delete_moves_the_run_to_the_trash_and_undo_brings_it_back_whole(run_dir):
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    trashed = trash_run(run_dir)
    assert trashed.parent == run_dir.parent / TRASH and not run_dir.exists()
    assert restore_run(trashed, run_dir) == run_dir
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before


def test_rename_refuses_bad_names_and_a_name_in_use(run_dir, make_config):
    other = Trainer(make_config(train__steps=2, run__name="other")).run().run_dir
    for bad in ("a/b", "", "..", TRASH, "sp ace"):
        with pytest.raises(UserError, match="not a run name"):
            rename_run(run_dir, bad)
    with pytest.raises(UserError, match="already exists"):
        rename_run(run_dir, other.name)
    new = rename_run(run_dir, "baseline")
    assert new == run_dir.parent / "baseline" and (new / "metrics.jsonl").exists() and not run_dir.exists()


@pytest.mark.slow
def test_a_run_still_training_is_neither_renamed_nor_deleted(tmp_path):
    runs = tmp_path / "runs"
    proc = start_long_cli_run(runs, "train.log_every=5", "train.eval_every=0", stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 90
        while not list(runs.glob("*/metrics.jsonl")) and time.monotonic() < deadline:
            time.sleep(0.2)
        (live,) = [p.parent for p in runs.glob("*/metrics.jsonl")]
        with pytest.raises(UserError, match=f"cannot delete {live.name}: .*in use by pid {proc.pid}"):
            trash_run(live)
        with pytest.raises(UserError, match=f"in use by pid {proc.pid}"):
            rename_run(live, "renamed")
        assert live.is_dir() and not (runs / TRASH).exists()
    finally:
        proc.kill()
        proc.wait(timeout=60)


def test_not_a_run_folder_is_said_one_way(tmp_path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "empty").mkdir()
    assert run_folder_problem(tmp_path / "nope") == f"{tmp_path / 'nope'} is not a run folder (it does not exist)"
    assert run_folder_problem(tmp_path / "file") == f"{tmp_path / 'file'} is not a run folder (it is a file)"
    assert run_folder_problem(tmp_path / "empty") == f"{tmp_path / 'empty'} is not a run folder (no metrics.jsonl)"
