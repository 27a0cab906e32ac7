"""ddp follows the single-process engine's rules on every rank, in float64.

One task file (task_files/ddp_kinds.py) holds what ddp must treat as lanes do: BatchNorm, dropout,
two output heads and a layer the forward never uses; every third batch holds one sample, so some ranks
have none. Each case is one ddp launch on 2 or 3 ranks, compared with the single-process engine on as
many lanes with the same weights (and, without dropout and with synchronized BatchNorm, with one
device: full-batch training): every logged loss, every validation loss, the final parameters and
buffers, to 1e-10.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
from pathlib import Path

import psutil
import pytest
import torch
from helpers import CLI, TASK_FILES
from multilane.engine.config import build_config
from multilane.engine.run.trainer import Trainer
from multilane.engine.rundir.runlog import read_metrics
from multilane.engine.tasks import make_task
from test_ddp import last_train_step, rank_pid, run_dirs, wait_for

pytestmark = pytest.mark.timeout(300)

KINDS = str(TASK_FILES / "ddp_kinds.py")
BOUND = 1e-10


def settings(steps: int, ranks: int, weights: list[int] | None, sync: bool, params: dict) -> dict:
    return {
        "task": {"name": KINDS, "params": params},
        "data": {"batch_size": 11, "val_fraction": 0.25},  # 23 train: batches of 11, 11, 1
        "optim": {"name": "adam", "lr": 0.01},
        "train": {"steps": steps, "grad_accum": 2, "log_every": 1, "eval_every": 2, "seed": 5},
        "devices": {
            "use": ",".join(f"cpu:{i}" for i in range(ranks)),
            "weights": weights or [],
            "sync_batchnorm": sync,
        },
        "telemetry": {"enabled": False},
    }


def single_process(tmp_path: Path, cfg: dict, name: str) -> tuple[dict, list[dict]]:
    cfg = {**cfg, "run": {"runs_dir": str(tmp_path / "ref"), "name": name}}
    trainer = Trainer(build_config(cfg), task=make_task(KINDS, cfg["task"]["params"]))
    result = trainer.run()
    assert result.status == "finished", result.message
    return trainer.model.state_dict(), read_metrics(result.run_dir)


def ddp(tmp_path: Path, cfg: dict, *args: str) -> Path:
    runs = tmp_path / "runs"
    cfg = {**cfg, "run": {"runs_dir": str(runs), "name": "ddp"}}
    path = tmp_path / "ddp.json"
    path.write_text(json.dumps(cfg))
    r = subprocess.run(
        [*CLI, "train", "--strategy", "ddp", "--config", str(path), *args], capture_output=True, text=True, timeout=240
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (run,) = run_dirs(runs)
    return run


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def assert_equal_runs(run: Path, state: dict, records: list[dict], what: str) -> None:
    ck = torch.load(run / "checkpoints" / "last.pt", weights_only=True)
    for key, ref in state.items():  # parameters and buffers (BatchNorm's running statistics)
        assert rel(ck["model"][key], ref) <= BOUND, f"{what}: {key} differs by {rel(ck['model'][key], ref):.2e}"
    mine = read_metrics(run)
    train = [(r["step"], r["loss"]) for r in mine if r["kind"] == "train"]
    ref_train = [(r["step"], r["loss"]) for r in records if r["kind"] == "train"]
    assert [s for s, _ in train] == [s for s, _ in ref_train]
    for (step, a), (_, b) in zip(train, ref_train, strict=True):
        assert abs(a - b) <= BOUND * abs(b), f"{what}: step {step} loss {a!r} != {b!r}"
    evals = {r["step"]: r["val_loss"] for r in mine if r["kind"] == "eval"}
    ref_evals = {r["step"]: r["val_loss"] for r in records if r["kind"] == "eval"}
    assert ref_evals and ref_evals.keys() <= evals.keys()  # (a resumed run also evaluated where it stopped)
    for step, b in ref_evals.items():
        assert abs(evals[step] - b) <= BOUND * abs(b), f"{what}: val_loss at step {step} {evals[step]!r} != {b!r}"


CASES = {
    # Dropout (each rank its own stream), BatchNorm's running statistics merged by samples, an unused
    # layer (find_unused_parameters stays on), an idle rank in every third batch.
    "3 ranks [3,1,2], dropout, unused layer": (3, [3, 1, 2], False, {"dropout": 0.3, "unused": True}),
    "2 ranks [1,3], dropout, unused layer": (2, [1, 3], False, {"dropout": 0.3, "unused": True}),
    # Synchronized BatchNorm: full-batch statistics; every parameter used (DDP drops find_unused after
    # step 1), so an idle rank must reach every parameter with zeros.
    "2 ranks, sync_batchnorm": (2, None, True, {"dropout": 0.0, "unused": False}),
    "3 ranks [3,1,2], sync_batchnorm": (3, [3, 1, 2], True, {"dropout": 0.0, "unused": False}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_ddp_equals_the_single_process_engine_on_as_many_lanes(tmp_path, case):
    ranks, weights, sync, params = CASES[case]
    cfg = settings(3, ranks, weights, sync, params)
    run = ddp(tmp_path, cfg)
    state, records = single_process(tmp_path, cfg, "lanes")
    assert_equal_runs(run, state, records, f"{case}, against {ranks} lanes")
    if sync and not params["dropout"]:  # full-batch statistics: also one device's training
        one = {**cfg, "devices": {"use": "cpu:0"}}
        state1, records1 = single_process(tmp_path, one, "one")
        assert_equal_runs(run, state1, records1, f"{case}, against one device")
    if ranks == 3 and params["dropout"]:
        # Every rank's random stream is in the checkpoint: resumed to step 5, the run draws the
        # masks of 5 straight steps on 3 lanes.
        ck = torch.load(run / "checkpoints" / "last.pt", weights_only=True)
        assert len(ck["lane_rng"]["lanes"]) == 3
        r = subprocess.run(
            [*CLI, "train", "--resume", str(run), "--steps", "5"], capture_output=True, text=True, timeout=240
        )
        assert r.returncode == 0, r.stderr[-3000:]
        state5, records5 = single_process(tmp_path, {**cfg, "train": {**cfg["train"], "steps": 5}}, "five")
        assert_equal_runs(run, state5, records5, f"{case}, resumed at step 3")


def test_a_tied_embedding_with_max_norm_is_refused_under_ddp_in_one_line(tmp_path):
    # Each rank would renormalise only its own shard's rows: refused, never a silent difference.
    task = str(TASK_FILES / "tied_maxnorm.py")
    runs = tmp_path / "runs"
    args = [*CLI, "train", "--strategy", "ddp", "--task", task, "--devices", "cpu:0,cpu:1", "--steps", "3"]
    r = subprocess.run(
        [*args, "--runs-dir", str(runs), "--set", "telemetry.enabled=false"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    # Before any rank starts (the model's Embedding(max_norm=...) found by the launcher): one line, exit 2.
    assert r.returncode == 2, r.stderr[-3000:]
    (line,) = [x for x in r.stderr.splitlines() if x.strip()]
    assert "changes its weight in place" in line and "replicate" in line, line
    assert run_dirs(runs) == []  # no run folder, not one step trained


ALL_PADDING = """
import torch
from multilane.engine.tasks import ArrayData, Task
from torch import nn
from torch.nn import functional as F


class AllPadding(Task):
    name = "all-padding"

    def build_model(self):
        return nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5)).double()

    def data(self):
        tokens = torch.randint(0, 5, (40, 3), generator=torch.Generator().manual_seed(1))
        return ArrayData(tokens, torch.full((40, 3), -100))  # every token is padding

    def loss(self, output, target):
        return F.cross_entropy(output.flatten(0, 1), target.flatten(), ignore_index=-100)

    def loss_weight(self, output, target):
        return (target != -100).sum()
"""


@pytest.mark.slow
def test_a_batch_without_loss_weight_stops_on_nan_under_ddp_as_under_replicate(tmp_path):
    # A batch whose every token is padding has a token mean of 0/0. One rule for
    # every strategy: the logged loss is NaN (null in metrics.jsonl) and the run diverged there, exit 3.
    task = tmp_path / "all_padding.py"
    task.write_text(ALL_PADDING)
    runs = tmp_path / "runs"
    args = [*CLI, "train", "--task", str(task), "--devices", "cpu:0,cpu:1", "--steps", "3", "--runs-dir", str(runs)]
    args += ["--strategy", "ddp", "--set", "telemetry.enabled=false", "--set", "train.log_every=1"]
    r = subprocess.run(args, capture_output=True, text=True, timeout=240)
    assert r.returncode == 3, r.stderr[-3000:]
    (run,) = run_dirs(runs)
    status = json.loads((run / "status.json").read_text())
    assert (status["state"], status["step"]) == ("diverged", 1), status
    # where it began (the NaN replay, under ddp every rank its shard): the 0/0 token mean is the loss's
    assert status["message"].startswith("loss became nan at step 1: every module's output was finite; the loss on ")
    assert [x["loss"] for x in read_metrics(run) if x["kind"] == "train"] == [None]
    # The single-process engine on two lanes: the same outcome.
    cfg = {"task": {"name": str(task)}, "devices": {"use": "cpu:0,cpu:1"}, "telemetry": {"enabled": False}}
    cfg |= {"train": {"steps": 3, "log_every": 1}, "run": {"runs_dir": str(tmp_path / "ref")}}
    result = Trainer(build_config(cfg)).run()
    assert (result.status, result.step) == ("diverged", 1), result.message
    # (where it began, from the NaN replay: every output finite, the 0/0 token mean is the loss's)
    assert result.message.startswith("loss became nan at step 1: every module's output was finite; the loss on cpu:")
    # the same words, a rank named where a lane is (the gradients a NaN loss makes NaN are named by neither)
    assert re.sub(r"[^\s/]+/rank\d+/(cpu:\d+)", r"\1", status["message"]) == result.message
    assert [x["loss"] for x in read_metrics(result.run_dir) if x["kind"] == "train"] == [None]


@pytest.mark.slow
def test_sigterm_to_the_launcher_with_dataloader_workers_stops_every_rank_at_one_step_with_a_checkpoint(tmp_path):
    # The launcher's SIGTERM reaches each rank's whole process
    # group; the DataLoader workers must leave it to their rank, which stops with the others.
    runs = tmp_path / "runs"
    args = [*CLI, "train", "--strategy", "ddp", "--task", str(TASK_FILES / "float64_dataset.py")]
    args += ["--devices", "cpu:0,cpu:1", "--runs-dir", str(runs), "--steps", "100000"]
    for s in ("data.workers=2", "train.log_every=1", "train.eval_every=0", "telemetry.enabled=false"):
        args += ["--set", s]
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        run = wait_for(lambda: (run_dirs(runs) or [None])[0], 60, "the run folder", p)
        wait_for(lambda: last_train_step(run) >= 3, 120, "training", p)
        ranks = [wait_for(lambda r=r: rank_pid(p, r), 30, f"rank {r}", p) for r in (0, 1)]
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=60)
    finally:
        p.kill()
    _, err = p.communicate()
    assert p.returncode == 0, err[-3000:]
    wait_for(lambda: not any(psutil.pid_exists(pid) for pid in ranks), 30, "the ranks to exit")
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "stopped", status
    step = int(torch.load(run / "checkpoints" / "last.pt", weights_only=True)["step"])
    assert step == status["step"] == last_train_step(run)
