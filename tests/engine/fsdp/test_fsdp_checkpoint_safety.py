"""A sharded (DCP) checkpoint is data, as ``last.pt`` is.

The folders here are made in this process (``shard_in_place``: DCP without a process group), from a
single-process run: a resume under another strategy loads them, and whatever DCP would unpickle (its
``.metadata`` index, its non-tensor entries) goes through an allowlist; a folder that asks for code,
points outside itself, or is named by a ``last.pt`` that points elsewhere is refused in one line.
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from fsdp_helpers import KINDS, settings, shard_in_place, single_process
from helpers import CLI
from multilane.engine.config import build_config
from multilane.engine.errors import UserError
from multilane.engine.fsdp.sharded import read_model_state, remove_older
from multilane.engine.run.trainer import Trainer
from multilane.engine.tasks import make_task

MARK = "fsdp-pwned"


class Payload:
    """Unpickled, it would create a file: the proof that code ran."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
    """A 2-step tiedbn run on one device, its checkpoint made sharded."""
    tmp = tmp_path_factory.mktemp("sharded")
    cfg = settings("tiedbn", 2, "cpu:0", strategy="replicate")
    trainer = Trainer(
        build_config({**cfg, "run": {"runs_dir": str(tmp / "runs")}}), task=make_task(KINDS, {"kind": "tiedbn"})
    )
    result = trainer.run()
    assert result.status == "finished", result.message
    shard_in_place(result.run_dir, trainer)
    return result.run_dir


@pytest.fixture
def run(sharded_run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(sharded_run, dst)
    (dst / ".lock").unlink(missing_ok=True)
    return dst


def folder(run):
    (name,) = [p for p in (run / "checkpoints").iterdir() if p.name.startswith("sharded-")]
    return name


def resume(run, steps=3):
    cfg_task = make_task(KINDS, {"kind": "tiedbn"})
    return Trainer(resume_from=run, overrides={"train.steps": steps}, task=cfg_task).run()


@pytest.mark.slow
def test_a_sharded_checkpoint_resumes_in_one_process_equal_to_a_straight_run(run, tmp_path):
    state3, _, _ = single_process(tmp_path, settings("tiedbn", 3, "cpu:0", strategy="replicate"), "three")
    result = resume(run)
    assert result.status == "finished", result.message
    # The resumed run saved a plain last.pt (one process): the model equals 3 straight steps.
    got = read_model_state(run)
    for k, v in state3.items():
        assert torch.allclose(got[k], v, rtol=0, atol=1e-12), k
    assert torch.equal(got["emb.weight"], got["head.weight"])  # still tied


def test_metadata_that_asks_for_code_is_refused_and_runs_nothing(run, tmp_path):
    marker = tmp_path / MARK
    (folder(run) / ".metadata").write_bytes(pickle.dumps(Payload(str(marker))))
    with pytest.raises(UserError, match=r"refused: its \.metadata asks for (io|builtins)\.open,") as e:
        resume(run)
    assert "\n" not in str(e.value)
    assert not marker.exists()
    with pytest.raises(UserError, match="refused"):  # reading the model alone too
        read_model_state(run)
    assert not marker.exists()


def tree(folder: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None) for p in folder.rglob("*")}


@pytest.mark.slow
@pytest.mark.parametrize("strategy, damage", [("fsdp", "garbage"), ("fsdp", "code"), ("ddp", "garbage")])
def test_a_resume_refused_in_the_ranks_is_one_line_exit_2_and_changes_no_byte(run, tmp_path, strategy, damage):
    # Every rank finds the index damaged: the launcher alone says so, once, as the one-process path does.
    marker = tmp_path / MARK
    meta = folder(run) / ".metadata"
    meta.write_bytes(b"garbage" if damage == "garbage" else pickle.dumps(Payload(str(marker))))
    (run / ".lock").write_bytes(b"4242\nthe-host-that-ran-it\n")  # as a finished run leaves it
    before = tree(run)
    args = ["--resume", str(run), "--strategy", strategy, "--devices", "cpu:0,cpu:1", "--steps", "3"]
    r = subprocess.run([*CLI, "train", *args], capture_output=True, text=True, timeout=180)
    assert r.returncode == 2, r.stderr[-3000:]
    assert len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith(f"multilane: error: checkpoint {folder(run)}: refused: its .metadata "), r.stderr
    assert tree(run) == before
    assert not marker.exists()


def test_metadata_naming_a_file_outside_the_folder_is_refused(run):
    from multilane.engine.fsdp.safe_reader import read_metadata_file

    path = folder(run) / ".metadata"
    md = read_metadata_file(path.read_bytes())
    for info in md.storage_data.values():
        info.relative_path = "../../../etc/passwd"
    path.write_bytes(pickle.dumps(md))
    with pytest.raises(UserError, match=r"names a data file '\.\./\.\./\.\./etc/passwd' outside the folder"):
        resume(run)


def test_an_entry_that_pickles_code_is_refused_and_runs_nothing(tmp_path):
    # DCP saves a non-tensor entry (an optimizer hyperparameter) with torch.save and loads it with
    # weights_only=False; ours loads it with weights_only=True.
    marker = tmp_path / MARK
    cfg = settings("mlp", 1, "cpu:0", strategy="replicate")
    trainer = Trainer(build_config({**cfg, "run": {"runs_dir": str(tmp_path / "runs")}}), task=make_task(KINDS, {}))
    result = trainer.run()
    name = shard_in_place(
        result.run_dir, trainer, edit=lambda st: st["optim"]["param_groups"][0].update(lr=Payload(str(marker)))
    )
    assert (result.run_dir / "checkpoints" / name / ".metadata").is_file()
    with pytest.raises(UserError, match=r"refused: its entry .*lr holds something other than plain data"):
        Trainer(resume_from=result.run_dir, overrides={"train.steps": 2}, task=make_task(KINDS, {})).run()
    assert not marker.exists()


@pytest.mark.parametrize("name", ["../../x", "sharded-2-0123abcd/..", "/etc", 5])
def test_last_pt_naming_another_place_is_refused(run, name):
    ck = torch.load(run / "checkpoints" / "last.pt", weights_only=True)
    torch.save({**ck, "sharded": name}, run / "checkpoints" / "last.pt")
    with pytest.raises(UserError, match="is not a checkpoint folder name"):
        resume(run)


def test_a_missing_or_half_written_folder_is_one_line(run):
    os.unlink(folder(run) / ".metadata")  # DCP writes its index last: a save killed before it
    with pytest.raises(UserError, match="missing or incomplete"):
        resume(run)


def test_older_and_crashed_saves_are_removed_once_last_pt_names_the_new_one(run):
    ck_dir = run / "checkpoints"
    keep = folder(run).name
    (ck_dir / "sharded-1-00000000").mkdir()  # the previous save's
    (ck_dir / ".sharded-3-11111111.tmp").mkdir()  # a save killed before its rename
    (ck_dir / "notes").mkdir()  # not ours: stays
    remove_older(ck_dir, keep)
    assert sorted(p.name for p in ck_dir.iterdir()) == sorted(["last.pt", keep, "notes"])
