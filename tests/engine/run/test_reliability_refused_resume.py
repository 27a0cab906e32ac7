"""A refused ``--resume`` leaves the run's lock file as it found it, and a checkpoint that
does not fit the run is refused naming the checkpoint (and what in it does not fit), not the task.
The CLI runs in-process (``main``); the run resumed is real (trained once per module)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from helpers import finished_linear_run
from multilane.engine.cli.main import main


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    return finished_linear_run(tmp_path_factory.mktemp("runs"))


def damaged(finished: Path, tmp_path: Path, part: str) -> Path:
    run = Path(shutil.copytree(finished, tmp_path / "run"))
    ck = run / "checkpoints" / "last.pt"
    state = torch.load(ck, weights_only=True)
    state[part] = {"model": {"bogus": torch.zeros(3)}, "optimizer": {"state": {}, "param_groups": []}}[part]
    torch.save(state, ck)
    return run


@pytest.mark.slow  # a real run to resume (trained once for the module)
@pytest.mark.parametrize(
    "part, words",
    [
        ("model", "the model weights it holds cannot be loaded into task linear's model"),
        ("optimizer", "the optimizer state it holds cannot be loaded into this run's adam optimizer"),
    ],
)
def test_a_checkpoint_that_does_not_fit_is_refused_naming_it_and_the_lock_file_stays_as_found(
    finished, tmp_path, capsys, part, words
):
    run = damaged(finished, tmp_path, part)
    lock = run / ".lock"
    lock.write_bytes(b"4242\nthe-first-writer\n")  # what the run's own writer left in it
    os.utime(lock, ns=(1_600_000_000_000_000_000, 1_600_000_000_000_000_000))
    before = (lock.read_bytes(), lock.stat().st_mtime_ns)
    status = (run / "status.json").read_bytes()
    code = main(["train", "--resume", str(run), "--steps", "4"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.splitlines() == [
        f"multilane: error: checkpoint {run / 'checkpoints' / 'last.pt'}: {words} " + err.split(words, 1)[1].strip()
    ]
    assert "setup failed" not in err and "task linear:" not in err
    assert (lock.read_bytes(), lock.stat().st_mtime_ns) == before  # not rewritten with the refused pid
    assert (run / "status.json").read_bytes() == status


@pytest.mark.slow  # the same module run
@pytest.mark.parametrize("strategy", ["replicate", "ddp"])
def test_a_checkpoint_whose_task_cannot_be_made_here_is_refused_naming_it(finished, tmp_path, capsys, strategy):
    run = Path(shutil.copytree(finished, tmp_path / "run"))
    ck = run / "checkpoints" / "last.pt"
    state = torch.load(ck, weights_only=True)
    state["config"]["task"]["name"] = "nosuch"  # a task this machine does not have
    torch.save(state, ck)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    code = main(["train", "--resume", str(run), "--steps", "4", "--strategy", strategy])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.splitlines() == [
        f"multilane: error: resume: {ck}: the task it was trained with cannot be made here: "
        + err.split("cannot be made here: ", 1)[1].strip()
    ]
    assert "unknown task 'nosuch'" in err
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before  # nothing written
