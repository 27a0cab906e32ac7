"""A NaN never reaches a ddp checkpoint: the ranks agree on the check before each save (one device read
each, then a tiny all-reduce), so a loss or an update that went non-finite between two log points leaves
``last.pt`` at the last finite step, equal to the single-process engine's straight run; the run is
``diverged``, the launcher exits 3, and the run resumes from it. Real launches: 2 ranks, Gloo, float64."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import CLI, DIVERGE_AT, DIVERGE_LAST_GOOD, DIVERGE_TASK, diverge_settings
from multilane.engine.config import build_config
from multilane.engine.fsdp.sharded import read_model_state
from multilane.engine.run.trainer import Trainer
from multilane.engine.tasks import make_task

pytestmark = pytest.mark.timeout(600)
BOUND = 1e-10  # a process strategy against the single-process engine (tests/engine/parallel)


def launch(tmp_path: Path, strategy: str, how: str) -> tuple[subprocess.CompletedProcess, Path]:
    runs = tmp_path / strategy
    path = tmp_path / f"{strategy}.json"
    path.write_text(json.dumps(diverge_settings(runs, "cpu:0,cpu:1", strategy, DIVERGE_AT, how)))
    r = subprocess.run([*CLI, "train", "--config", str(path)], capture_output=True, text=True, timeout=300)
    (run,) = [p for p in runs.iterdir() if (p / "status.json").is_file()]
    return r, run


def straight(tmp_path: Path, steps: int) -> dict[str, torch.Tensor]:
    """The single-process engine on 2 lanes, no NaN, ``steps`` steps."""
    cfg = diverge_settings(tmp_path / f"straight{steps}", "cpu:0,cpu:1", "replicate", 0, steps=steps)
    trainer = Trainer(build_config(cfg), task=make_task(DIVERGE_TASK, cfg["task"]["params"]))
    assert trainer.run().status == "finished"
    return {k: v.detach() for k, v in trainer.model.state_dict().items()}


def assert_close(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for k, v in want.items():
        assert torch.isfinite(got[k]).all(), f"{what}: {k} is not finite"
        diff = float((got[k].double() - v).abs().max() / v.abs().max().clamp_min(1e-300))
        assert diff <= BOUND, f"{what}: {k} differs from the straight run's by {diff:.2e}"


def check_diverged(tmp_path: Path, strategy: str, how: str) -> Path:
    """Launch, and check what every strategy promises; the run folder."""
    r, run = launch(tmp_path, strategy, how)
    assert r.returncode == 3, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    status = json.loads((run / "status.json").read_text())
    assert (status["state"], status["step"]) == ("diverged", DIVERGE_AT), status
    if how == "weights":
        assert status["message"].startswith(
            f"the weights or the optimizer's state became non-finite at step {DIVERGE_AT}"
        ), status
    else:
        assert status["message"].startswith(f"loss became nan at step {DIVERGE_AT}"), status
    ck = torch.load(run / "checkpoints" / "last.pt", weights_only=True)
    assert ck["step"] == DIVERGE_LAST_GOOD
    assert_close(read_model_state(run), straight(tmp_path, DIVERGE_LAST_GOOD), f"{strategy} {how}")
    return run


def resume_clean(tmp_path: Path, run: Path, strategy: str) -> None:
    """Resumed with the bad samples gone: equal to a straight run of every step."""
    r = subprocess.run([*CLI, "train", "--resume", str(run), "--set", "task.params.at=0"], capture_output=True,
                       text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((run / "status.json").read_text())["state"] == "finished"
    assert_close(read_model_state(run), straight(tmp_path, 12), f"{strategy} resumed")


# "weights" (one launch, ~2 s with the warm ranks) stays in the fast tier; "loss" also resumes.
@pytest.mark.parametrize("how", [pytest.param("loss", marks=pytest.mark.slow), "weights"])
def test_ddp_keeps_the_last_finite_checkpoint_and_ends_diverged(tmp_path, how):
    run = check_diverged(tmp_path, "ddp", how)
    if how == "loss":
        resume_clean(tmp_path, run, "ddp")
