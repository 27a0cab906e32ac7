"""A damaged checkpoint is named, not blamed on the task: resuming from a checkpoint cut short, emptied,
overwritten with junk, changed after it was written, of the wrong shape, missing what a resume needs, or
another task's, says in one line (exit 2) which file and what is wrong with it, and leaves the run
folder exactly as it was (every file's bytes, its lock file's time)."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from helpers import finished_linear_run
from multilane.engine.cli.main import main


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    return finished_linear_run(tmp_path_factory.mktemp("runs"))


def _edit(**changes):
    def change(path: Path) -> None:
        ck = torch.load(path, weights_only=True)
        for key, value in changes.items():
            if value is None:
                ck.pop(key, None)
            else:
                ck[key] = value(ck) if callable(value) else value
        torch.save(ck, path)

    return change


def _cut(fraction):
    return lambda path: os.truncate(path, int(path.stat().st_size * fraction))


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 32):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE = {
    "cut to half": (_cut(0.5), "cut short or damaged"),
    "cut by one byte": (lambda p: os.truncate(p, p.stat().st_size - 1), "cut short or damaged"),
    "cut to 100 bytes": (lambda p: os.truncate(p, 100), "cut short or damaged"),
    "zero bytes": (lambda p: os.truncate(p, 0), "is empty (0 bytes"),
    "random bytes": (lambda p: p.write_bytes(os.urandom(4000)), "cannot load it"),
    "bytes changed inside": (_flip, "fails its checksum"),
    "a pickle, not torch's": (lambda p: p.write_bytes(pickle.dumps({"a": 1})), "cannot load it"),
    "a list": (lambda p: torch.save([1, 2, 3], p), "not a Multilane checkpoint (it holds a list"),
    "no model": (_edit(model=None), "not a Multilane checkpoint (no model state)"),
    "no step": (_edit(step=None), "not a Multilane checkpoint (step = None"),
    "weights of the wrong shape": (
        _edit(model=lambda ck: {k: torch.zeros(3, 3) for k in ck["model"]}),
        "the model weights it holds cannot be loaded into task linear's model",
    ),
    "a float random state": (_edit(rng=lambda ck: ck["rng"].float()), "its random state is not a generator's"),
    "a short random state": (_edit(rng=lambda ck: ck["rng"][:10]), "the random state it holds cannot be loaded"),
    "lanes' random junk": (_edit(lane_rng={"lanes": [[torch.zeros(3)]]}), "its lanes' random states are not"),
    "a step past its total": (_edit(step=10**9), "step 1000000000 is past its total_steps 2"),
    "another task's": (
        _edit(config=lambda ck: {**ck["config"], "task": {"name": "digits", "params": {}}}),
        "trained with task 'digits', but the run folder's config.json names task 'linear'",
    ),
}


def _files(run: Path) -> dict:
    return {p.relative_to(run): (p.read_bytes(), p.stat().st_mtime_ns) for p in run.rglob("*") if p.is_file()}


@pytest.mark.parametrize(  # a real run to resume (trained once for the module); the reported case stays fast
    "damage", [d if d == "cut to half" else pytest.param(d, marks=pytest.mark.slow) for d in DAMAGE]
)
def test_a_damaged_checkpoint_is_named_in_one_line_and_the_folder_is_left_as_it_was(finished, tmp_path, capsys, damage):
    run = Path(shutil.copytree(finished, tmp_path / "run"))
    ck = run / "checkpoints" / "last.pt"
    spoil, words = DAMAGE[damage]
    spoil(ck)
    before = _files(run)
    code = main(["train", "--resume", str(run), "--steps", "4"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"multilane: error: checkpoint {ck}: ") and words in err, err
    assert "setup failed" not in err and "task linear:" not in err
    assert _files(run) == before  # every file's bytes and time: nothing was written
