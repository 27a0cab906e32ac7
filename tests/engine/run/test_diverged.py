"""A NaN never reaches a checkpoint: a run whose loss (or weights) goes non-finite between two log
points, with checkpoints more often than logs, keeps the last finite state in ``last.pt`` (equal to a
straight run to that step), ends ``diverged`` (not ``stopped``: a user's Stop) with exit 3, and resumes
from it. The one-process strategies here; ddp and fsdp in tests/engine/distributed and tests/engine/fsdp."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import CLI, DIVERGE_AT, DIVERGE_LAST_GOOD, DIVERGE_TASK, diverge_settings
from multilane.engine.config import build_config
from multilane.engine.errors import EXIT_DIVERGED
from multilane.engine.run.control import RunControl
from multilane.engine.run.trainer import Trainer
from multilane.engine.rundir.runlog import read_metrics
from multilane.engine.tasks import make_task

TASK = DIVERGE_TASK
AT, LAST_GOOD = DIVERGE_AT, DIVERGE_LAST_GOOD  # checkpoints every 2 steps, logs every 5: step 8 between logs
settings = diverge_settings


def train(cfg: dict, **kw):
    trainer = Trainer(build_config(cfg), task=make_task(TASK, cfg["task"]["params"]), **kw)
    return trainer, trainer.run()


def straight(tmp_path: Path, devices: str, strategy: str, steps: int) -> dict[str, torch.Tensor]:
    """The model of a run with no NaN, ``steps`` steps long, on the same devices and strategy."""
    _, result = train(settings(tmp_path / f"straight{steps}", devices, strategy, at=0, steps=steps))
    assert result.status == "finished", result.message
    return torch.load(result.run_dir / "checkpoints" / "last.pt", weights_only=True)["model"]


def assert_same_model(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for k, v in want.items():
        assert torch.isfinite(got[k]).all(), f"{what}: {k} is not finite"
        diff = float((got[k] - v).abs().max() / v.abs().max().clamp_min(1e-300))
        assert diff <= 1e-12, f"{what}: {k} differs from a straight run's by {diff:.2e}"


SAVES = {
    # the checkpoint_minutes cadence (due after every step here): the save after step 7 is the last
    "by time": ({"checkpoint_every": 0, "checkpoint_minutes": 1e-9}, AT, AT - 1),  # 8 fsynced saves: slow
    # the run's last step, whose save follows its log: the NaN at step 12 leaves step 10's
    "the last step": ({}, 12, 10),
}


@pytest.mark.parametrize("save", [pytest.param("by time", marks=pytest.mark.slow), "the last step"])
def test_every_kind_of_save_is_checked(tmp_path, save):
    train_over, at, kept = SAVES[save]
    cfg = settings(tmp_path / "runs", "cpu:0", "replicate", at)
    cfg["train"].update(train_over)
    cfg["health"] = {"nan_replay": False}
    _, result = train(cfg)
    assert (result.status, result.step) == ("diverged", at), result.message
    ck = torch.load(result.run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert ck["step"] == kept
    assert_same_model(ck["model"], straight(tmp_path, "cpu:0", "replicate", kept), save)


CASES = [("cpu:0", "replicate"), ("cpu:0,cpu:1", "replicate"), ("cpu:0,cpu:1", "persistent")]


def test_a_nan_loss_between_logs_keeps_the_last_finite_checkpoint_on_one_lane(tmp_path):
    # The fast tier's case: one lane, the loss NaN at step 8, checkpoints every 2 steps, logs every 5.
    _, result = train(settings(tmp_path / "runs", "cpu:0", "replicate", AT))
    assert (result.status, result.step) == ("diverged", AT), result.message
    assert result.message.startswith(f"loss became nan at step {AT}: non-finite values in the input data")
    ck = torch.load(result.run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert ck["step"] == LAST_GOOD
    assert all(torch.isfinite(v).all() for v in ck["model"].values())
    status = json.loads((result.run_dir / "status.json").read_text())
    assert (status["state"], status["step"]) == ("diverged", AT) and status["message"] == result.message
    train_records = [r for r in read_metrics(result.run_dir) if r["kind"] == "train"]
    assert [(r["step"], r["loss"] is None) for r in train_records] == [(5, False), (AT, True)]  # the NaN is logged
    events = [r["event"] for r in read_metrics(result.run_dir) if r["kind"] == "event"]
    assert events[-1] == "diverged" and "nonfinite_origin" in events and "stopped" not in events


@pytest.mark.parametrize("how", ["loss", "weights"])
@pytest.mark.parametrize(("devices", "strategy"), CASES, ids=["1-lane", "2-lanes", "persistent-2"])
def test_last_pt_holds_the_last_finite_step_equal_to_a_straight_run_and_resumes(tmp_path, devices, strategy, how):
    # "weights": step 8's loss is finite but an inf gradient makes its update non-finite; the state
    # after step 8 is not saved either (the parameters are checked as well as the losses).
    _, result = train(settings(tmp_path / "runs", devices, strategy, AT, how))
    assert (result.status, result.step) == ("diverged", AT), result.message
    if how == "weights":
        assert result.message.startswith(
            f"the weights or the optimizer's state became non-finite at step {AT}: first non-finite gradient"
        )
    ck = torch.load(result.run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert ck["step"] == LAST_GOOD
    assert_same_model(ck["model"], straight(tmp_path, devices, strategy, LAST_GOOD), f"{devices} {strategy} {how}")
    # Resumed from it with the bad samples gone: the same model as a straight run of all 12 steps.
    resumed = Trainer(resume_from=result.run_dir, overrides={"task.params": {"at": 0, "how": how}})
    end = resumed.run()
    assert (end.status, end.step) == ("finished", 12), end.message
    got = torch.load(end.run_dir / "checkpoints" / "last.pt", weights_only=True)["model"]
    assert_same_model(got, straight(tmp_path, devices, strategy, 12), f"{devices} {strategy} {how}, resumed")


def test_a_stop_after_the_nan_saves_nothing_and_the_run_diverged_not_stopped(tmp_path):
    # A Stop asked between step 8 (NaN) and the next log: the stop's checkpoint would hold the NaN.
    control = RunControl()
    cfg = settings(tmp_path / "runs", "cpu:0,cpu:1", "replicate", AT)
    cfg["train"]["checkpoint_every"] = 0  # only the stop's checkpoint (and the final one)
    cfg["train"]["checkpoint_minutes"] = 0
    trainer = Trainer(build_config(cfg), task=make_task(TASK, cfg["task"]["params"]), control=control)
    original = trainer.spread.train_step

    def step_then_stop(t, accum):
        original(t, accum)
        if trainer.step + 1 == AT + 1:  # step 9 done: stop before step 10 (the log)
            control.request_stop()

    trainer.spread.train_step = step_then_stop
    result = trainer.run()
    assert result.status == "diverged", result.message
    assert not (result.run_dir / "checkpoints" / "last.pt").exists()  # nothing finite was ever saved after 0


@pytest.mark.slow
def test_the_cli_exits_3_and_watch_prints_diverged(tmp_path):
    runs = tmp_path / "runs"
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(settings(runs, "cpu:0", "replicate", AT)))
    r = subprocess.run([*CLI, "train", "--config", str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == EXIT_DIVERGED == 3, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    (run,) = [p for p in runs.iterdir() if p.is_dir() and not p.name.startswith(".")]
    w = subprocess.run([*CLI, "watch", str(run)], capture_output=True, text=True, timeout=60)
    assert w.returncode == 3, w.stdout + w.stderr
    assert w.stdout.strip().splitlines()[-1].startswith(f"diverged: step {AT}/12"), w.stdout
    assert "loss became nan" in w.stdout
