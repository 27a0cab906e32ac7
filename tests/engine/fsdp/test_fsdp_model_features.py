"""fsdp and the model features it cannot shard: each refused before any rank starts, in one line naming
the feature and a strategy that trains it (exit 2, no run folder); what it does train, exact and quiet.

The kinds are tests/task_files/param_kinds.py's. FSDP2 warns at every forward of a unit that returns a
view ("... can cause backward to fail or produce wrong gradients"); the engine checks what that warning
is about (the view changed in place: refused) and filters it, so an exact run prints none of them, while
a warning of the model's own is shown once for the whole run (launcher, probe and ranks together).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from fsdp_helpers import rel
from helpers import CLI, TASK_FILES
from multilane.engine.config import build_config
from multilane.engine.fsdp.sharded import read_model_state
from multilane.engine.run.trainer import Trainer
from multilane.engine.rundir.runlog import read_metrics
from multilane.engine.tasks import make_task

pytestmark = pytest.mark.timeout(300)

KINDS = str(TASK_FILES / "param_kinds.py")
VIEW_WARNING = "returned a view tensor"


def settings(params: dict, devices: str = "cpu:0,cpu:1", **train) -> dict:
    return {
        "task": {"name": KINDS, "params": {"samples": 40, **params}},
        "data": {"batch_size": 8, "val_fraction": 0.25, "workers": 0},
        "optim": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
        "train": {"steps": 3, "grad_accum": 2, "grad_clip": 0.3, "log_every": 1, "eval_every": 2, "seed": 5, **train},
        "devices": {"use": devices, "strategy": "fsdp", "weights": [1, 3] if "," in devices else []},
        "health": {"every": 1},
    }


def train(tmp_path: Path, cfg: dict) -> subprocess.CompletedProcess:
    cfg = {**cfg, "run": {"runs_dir": str(tmp_path / "runs"), "name": "fsdp"}}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(cfg))
    env = {**os.environ, "MULTILANE_FIT_CHECK": "1"}  # the fit check on (the suite turns it off)
    return subprocess.run([*CLI, "train", "--config", str(path)], capture_output=True, text=True, timeout=280, env=env)


def assert_refused(tmp_path: Path, r: subprocess.CompletedProcess, *words: str) -> None:
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("multilane: error: devices.strategy = fsdp: "), r.stderr
    for w in words:
        assert w in lines[0], lines[0]
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir()), "no run folder"


CASES = {
    "sparse": ("emb (Embedding(sparse=True)) makes sparse gradients", '"ddp", "replicate" or "persistent"'),
    "scalar": ("parameter 'scale' is 0-dim", '"ddp"'),
    "maxnorm": ("emb (Embedding(max_norm=1)) changes its weight in place", '"replicate" or "persistent"'),
    "paramread": ("forward computes with parameters outside the unit", '"ddp"', "fsdp_units(model) returning []"),
    "viewadd": ("changes the output of an FSDP unit (Linear, a view) in place", '"ddp"'),
}


def test_a_sparse_embedding_is_refused_under_fsdp_before_any_rank(tmp_path):
    assert_refused(tmp_path, train(tmp_path, settings({"kind": "sparse"})), *CASES["sparse"])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["scalar", "maxnorm", "paramread", "viewadd"])
def test_each_feature_fsdp_cannot_shard_is_refused_before_any_rank(tmp_path, kind):
    assert_refused(tmp_path, train(tmp_path, settings({"kind": kind})), *CASES[kind])


@pytest.mark.slow
@pytest.mark.parametrize(("params", "units"), [({"kind": "views"}, "default"), ({"kind": "paramread"}, "one")])
def test_what_fsdp_trains_is_exact_and_prints_no_accounted_warning(tmp_path, params, units):
    """``views``: a unit returns a view (FSDP2 warns at each forward); ``paramread`` with the task's
    ``fsdp_units`` returning none: the whole model one unit, so the forward reads gathered parameters.
    The model warns in its own forward at every step: shown once."""
    params = {**params, "one_unit": units == "one", "warn": True}
    cfg = settings(params)
    ref = {**cfg, "devices": {"use": "cpu:0"}, "run": {"runs_dir": str(tmp_path / "ref"), "name": "ref"}}
    trainer = Trainer(build_config(ref), task=make_task(KINDS, params))
    assert trainer.run().status == "finished"
    r = train(tmp_path, cfg)
    assert r.returncode == 0, r.stderr[-3000:]
    assert VIEW_WARNING not in r.stderr
    assert r.stderr.count("UserWarning: paramkinds: this model warns in its forward") == 1, r.stderr
    run = next(p for p in (tmp_path / "runs").iterdir() if p.is_dir())
    mine = read_model_state(run)
    for key, want in trainer.model.state_dict().items():
        assert rel(mine[key], want) <= 1e-10, key
    losses = [x["loss"] for x in read_metrics(run) if x["kind"] == "train"]
    want = [x["loss"] for x in read_metrics(trainer.run_dir.path) if x["kind"] == "train"]
    assert len(losses) == len(want) == 3
    assert all(abs(a - b) <= 1e-10 * abs(b) for a, b in zip(losses, want, strict=True))
