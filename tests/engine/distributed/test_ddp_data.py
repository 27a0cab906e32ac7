"""The ddp strategy on Dataset and stream tasks: each rank reads its shard of the single-process
engine's global batches (through torch's DataLoader), with the same numbers and an exact resume on
any number of processes; a task's text sample at evaluation. Real processes, Gloo, 127.0.0.1.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
from helpers import CLI, TASK_FILES, max_rel_diff
from multilane.engine.config import build_config
from multilane.engine.run.trainer import Trainer
from multilane.engine.rundir.runlog import read_metrics
from multilane.engine.tasks import make_task
from test_ddp import assert_same_run, float64_settings, model_from, run_dirs

pytestmark = pytest.mark.timeout(300)

DATASET = str(TASK_FILES / "float64_dataset.py")


def settings(steps: int, params: dict, workers: int) -> dict:
    cfg = float64_settings(steps, DATASET)
    cfg["task"]["params"] = params
    cfg["data"]["workers"] = workers
    return cfg


def reference(tmp_path: Path, steps: int, params: dict) -> tuple[Trainer, list[dict]]:
    """The single-process engine on one device, on the same Dataset task."""
    cfg = settings(steps, params, 0)
    cfg["devices"] = {"use": "cpu:0"}
    cfg["run"] = {"runs_dir": str(tmp_path / "ref"), "name": f"ref{steps}"}
    trainer = Trainer(build_config(cfg), task=make_task(DATASET, params))
    result = trainer.run()
    assert result.status == "finished", result.message
    return trainer, read_metrics(result.run_dir)


def ddp(tmp_path: Path, cfg: dict, devices: str) -> Path:
    runs = tmp_path / "runs"
    cfg["run"] = {"runs_dir": str(runs), "name": "ddp"}
    path = tmp_path / "ddp.json"
    path.write_text(json.dumps(cfg))
    r = subprocess.run(
        [*CLI, "train", "--strategy", "ddp", "--config", str(path), "--devices", devices],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (run,) = run_dirs(runs)
    return run


def resume(run: Path, steps: int, devices: str, *extra: str) -> None:
    r = subprocess.run(
        [*CLI, "train", "--resume", str(run), "--steps", str(steps), "--devices", devices, *extra],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("params", "workers", "devices_after"),
    [
        # One Dataset split by the engine, a random augmentation; resumed on three ranks with a worker each.
        ({"kind": "map", "noise": True}, 0, "cpu:0,cpu:1,cpu:2"),
        # A (train, validation) pair read by two workers a rank; resumed on one rank.
        ({"kind": "pair", "noise": True}, 2, "cpu:0"),
        # Streams: every rank reads the whole stream and keeps its slice; resumed (by replaying) on two.
        ({"kind": "stream"}, 0, "cpu:0,cpu:1"),
    ],
    ids=["map", "pair", "stream"],
)
def test_ddp_on_a_dataset_task_equals_the_single_process_engine_and_resumes_on_any_rank_count(
    tmp_path, params, workers, devices_after
):
    # 77 samples to train on in batches of 19 (10/9 per rank, and a batch of one, rank 1's slice
    # empty), two micro-batches a step: step 3 ends mid-epoch 1.
    run = ddp(tmp_path, settings(3, params, workers), "cpu:0,cpu:1")
    ref3, ref3_records = reference(tmp_path, 3, params)
    assert max_rel_diff(model_from(run, DATASET), ref3.model) <= 1e-10
    assert_same_run(read_metrics(run), ref3_records)
    resume(run, 6, devices_after, "--set", "data.workers=1")
    ref6, ref6_records = reference(tmp_path, 6, params)
    assert max_rel_diff(model_from(run, DATASET), ref6.model) <= 1e-10
    assert_same_run(read_metrics(run), ref6_records)


@pytest.mark.slow
def test_charlm_under_ddp_writes_its_text_sample_at_every_evaluation_from_rank_0(tmp_path):
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("the cat sat on the mat.\nthe dog sat on the log.\n" * 20)
    params = {"path": str(corpus), "context": 16, "layers": 1, "width": 16, "heads": 2, "sample_bytes": 24}
    params["dropout"] = 0.0
    cfg = {
        "task": {"name": "charlm", "params": params},
        "data": {"batch_size": 16, "workers": 0},
        "train": {"steps": 4, "log_every": 2, "eval_every": 2, "seed": 1},
        "telemetry": {"enabled": False},
    }
    run = ddp(tmp_path, dict(cfg), "cpu:0,cpu:1")
    evals = [r for r in read_metrics(run) if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [2, 4]
    assert all(isinstance(r["sample"], str) and r["sample"] for r in evals)
    text = (run / "samples.txt").read_text()
    assert text.count("--- step ") == 2 and "--- step 4\n" in text
    # The same text and validation loss as the single-process engine (float32: a padded token mean
    # summed in another order, so not to the last bit).
    ref = Trainer(build_config({**cfg, "devices": {"use": "cpu:0"}, "run": {"runs_dir": str(tmp_path / "ref")}}))
    result = ref.run()
    assert result.status == "finished", result.message
    assert math.isclose(evals[-1]["val_loss"], result.last_eval["val_loss"], rel_tol=1e-4)
    assert (result.run_dir / "samples.txt").read_text() == text
