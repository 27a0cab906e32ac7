"""ddp with sparse gradients (``Embedding(sparse=True)``, ``EmbeddingBag(sparse=True)`` beside a layer no
sample uses), every instrument on, equal to the single-process engine on one device in float64; the
sparse-gradient models DDP cannot train refused before any rank starts, in one line (exit 2).

The kinds are tests/task_files/param_kinds.py's. 30 samples to train in batches of 8 (a last batch of 6)
on ranks with shares [1, 3], two micro-batches a step: some micro-batches leave a rank one sample or none.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from helpers import CLI, TASK_FILES
from multilane.engine.config import build_config
from multilane.engine.run.trainer import Trainer
from multilane.engine.rundir.runlog import read_metrics
from multilane.engine.tasks import make_task

pytestmark = pytest.mark.timeout(300)

KINDS = str(TASK_FILES / "param_kinds.py")


def settings(kind: str, strategy: str, devices: str, **more) -> dict:
    return {
        "task": {"name": KINDS, "params": {"kind": kind, "samples": 40}},
        "data": {"batch_size": 8, "val_fraction": 0.25, "workers": 0},
        "optim": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
        "train": {"steps": 4, "grad_accum": 2, "grad_clip": 0.3, "log_every": 1, "eval_every": 2, "seed": 5},
        "devices": {"use": devices, "strategy": strategy, **more},
        "health": {"every": 1},
    }


def one_device(tmp_path: Path, cfg: dict) -> tuple[dict, list[dict]]:
    cfg = {**cfg, "devices": {"use": "cpu:0"}, "run": {"runs_dir": str(tmp_path / "ref"), "name": "ref"}}
    trainer = Trainer(build_config(cfg), task=make_task(KINDS, cfg["task"]["params"]))
    result = trainer.run()
    assert result.status == "finished", result.message
    return trainer.model.state_dict(), read_metrics(result.run_dir)


def train(tmp_path: Path, cfg: dict, fit_check: bool = True) -> subprocess.CompletedProcess:
    cfg = {**cfg, "run": {"runs_dir": str(tmp_path / "runs"), "name": cfg["devices"]["strategy"]}}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(cfg))
    env = {**os.environ, "MULTILANE_FIT_CHECK": "1" if fit_check else "0"}  # the suite turns it off
    return subprocess.run([*CLI, "train", "--config", str(path)], capture_output=True, text=True, timeout=280, env=env)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sparse", "sparse_bag"])
def test_sparse_gradients_under_ddp_equal_one_device(tmp_path, kind):
    from multilane.engine.fsdp.sharded import read_model_state

    cfg = settings(kind, "ddp", "cpu:0,cpu:1", weights=[1, 3])
    state, records = one_device(tmp_path, cfg)
    # With the fit check: its probe drives the ddp strategy's own step, whose first steps find the layer no
    # rank uses (sparse_bag has one) as the run's do, so DDP never waits for its gradient.
    r = train(tmp_path, cfg)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    run = next(p for p in (tmp_path / "runs").iterdir() if p.is_dir())
    mine = read_model_state(run)
    for key, ref in state.items():
        diff = float((mine[key] - ref).abs().max() / ref.abs().max().clamp_min(1e-300))
        assert diff <= 1e-10, f"{kind}: {key} differs by {diff:.2e}"
    got = [(x["step"], x["loss"], x["grad_norm"]) for x in read_metrics(run) if x["kind"] == "train"]
    want = [(x["step"], x["loss"], x["grad_norm"]) for x in records if x["kind"] == "train"]
    assert [g[0] for g in got] == [w[0] for w in want] == [1, 2, 3, 4]
    for (step, loss, norm), (_, ref_loss, ref_norm) in zip(got, want, strict=True):
        assert abs(loss - ref_loss) <= 1e-10 * abs(ref_loss), (kind, step)
        assert abs(norm - ref_norm) <= 1e-10 * abs(ref_norm), (kind, step)
    assert all(x["memory"] for x in read_metrics(run) if x["kind"] == "train")
    # The noise scale from each rank's gradient (DDP's sparse buckets are uncoalesced) equals two lanes'.
    lanes = {**cfg, "devices": {**cfg["devices"], "strategy": "persistent"}}
    lanes["run"] = {"runs_dir": str(tmp_path / "lanes"), "name": "lanes"}
    trainer = Trainer(build_config(lanes), task=make_task(KINDS, cfg["task"]["params"]))
    assert trainer.run().status == "finished"
    noise = [x.get("noise") for x in read_metrics(run) if x["kind"] == "train"]
    assert noise == [x.get("noise") for x in read_metrics(trainer.run_dir.path) if x["kind"] == "train"]
    assert all(n is not None for n in noise)


@pytest.mark.parametrize(
    ("kind", "words"),
    [
        ("sparse_tied", "emb (Embedding(sparse=True), its weight tied to head) gets a dense gradient"),
        ("maxnorm", "emb (Embedding(max_norm=1)) changes its weight in place during the forward"),
    ],
)
def test_what_ddp_cannot_train_is_refused_before_any_rank_in_one_line(tmp_path, kind, words):
    r = train(tmp_path, settings(kind, "ddp", "cpu:0,cpu:1"))
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("multilane: error: devices.strategy = ddp: "), r.stderr
    assert words in lines[0] and '"replicate" or "persistent"' in lines[0]
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir()), "no run folder"
