"""Shared by the fsdp tests: a single-process reference run, a sharded checkpoint made in this
process (no process group: DCP's own no_dist mode), comparisons at 1e-10."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import torch
from helpers import CLI, TASK_FILES
from multilane.engine.config import build_config
from multilane.engine.fsdp.sharded import read_model_state
from multilane.engine.run.trainer import Trainer
from multilane.engine.rundir.runlog import read_metrics
from multilane.engine.tasks import make_task

KINDS = str(TASK_FILES / "fsdp_kinds.py")
BOUND = 1e-10


def run_dirs(runs: Path) -> list[Path]:
    return sorted(p for p in runs.glob("*") if p.is_dir())


def settings(kind: str, steps: int, devices: str, strategy: str = "fsdp", **more: Any) -> dict:
    optim = {"name": "sgd", "lr": 0.1, "momentum": 0.9} if kind in ("mlp", "cnn") else {"name": "adam", "lr": 0.01}
    cfg = {
        "task": {"name": KINDS, "params": {"kind": kind}},
        "data": {"batch_size": 11, "val_fraction": 0.25, "workers": 0},
        "optim": optim,
        "train": {"steps": steps, "grad_accum": 2, "grad_clip": 0.3, "log_every": 1, "eval_every": 2, "seed": 5},
        "devices": {"use": devices, "strategy": strategy, "weights": more.pop("weights", [])},
        "telemetry": {"enabled": False},
    }
    cfg["devices"].update(more)
    return cfg


def single_process(tmp_path: Path, cfg: dict, name: str) -> tuple[dict, list[dict], Path]:
    cfg = {**cfg, "devices": {"use": "cpu:0"}, "run": {"runs_dir": str(tmp_path / "ref"), "name": name}}
    trainer = Trainer(build_config(cfg), task=make_task(KINDS, cfg["task"]["params"]))
    result = trainer.run()
    assert result.status == "finished", result.message
    return trainer.model.state_dict(), read_metrics(result.run_dir), result.run_dir


def launch(tmp_path: Path, cfg: dict, *args: str, runs: Path | None = None) -> subprocess.CompletedProcess:
    runs = runs or tmp_path / "runs"
    cfg = {**cfg, "run": {"runs_dir": str(runs), "name": cfg["devices"]["strategy"]}}
    path = tmp_path / "launch.json"
    path.write_text(json.dumps(cfg))
    r = subprocess.run([*CLI, "train", "--config", str(path), *args], capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def resume(run: Path, *args: str) -> None:
    r = subprocess.run([*CLI, "train", "--resume", str(run), *args], capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stderr[-3000:]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def assert_equal_runs(run: Path, state: dict, records: list[dict], what: str) -> None:
    """Parameters and buffers (from the sharded checkpoint), every logged loss and gradient norm,
    every validation loss: equal to the reference's within ``BOUND``."""
    mine_state = read_model_state(run)
    assert mine_state.keys() == state.keys(), what
    for key, ref in state.items():
        assert rel(mine_state[key], ref) <= BOUND, f"{what}: {key} differs by {rel(mine_state[key], ref):.2e}"
    mine = read_metrics(run)
    for field in ("loss", "grad_norm"):
        got = [(r["step"], r.get(field)) for r in mine if r["kind"] == "train" and not r.get("partial")]
        ref = [(r["step"], r.get(field)) for r in records if r["kind"] == "train"]
        assert [s for s, _ in got] == [s for s, _ in ref], what
        for (step, a), (_, b) in zip(got, ref, strict=True):
            assert (a is None) == (b is None), f"{what}: step {step} {field} {a!r} vs {b!r}"
            assert a is None or abs(a - b) <= BOUND * abs(b), f"{what}: step {step} {field} {a!r} != {b!r}"
    evals = {r["step"]: r["val_loss"] for r in mine if r["kind"] == "eval"}
    ref_evals = {r["step"]: r["val_loss"] for r in records if r["kind"] == "eval"}
    assert ref_evals and ref_evals.keys() <= evals.keys(), what
    for step, b in ref_evals.items():
        assert abs(evals[step] - b) <= BOUND * abs(b), f"{what}: val_loss at step {step} {evals[step]!r} != {b!r}"


def shard_in_place(run: Path, trainer: Trainer, edit: Any = None) -> str:
    """Turn ``run``'s plain checkpoint into a sharded one, as an fsdp run writes it (one rank)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    ck = torch.load(run / "checkpoints" / "last.pt", weights_only=True)
    name = f"sharded-{ck['step']}-0123abcd"
    msd, osd = get_state_dict(trainer.model, trainer.optimizer)
    state = {"model": msd, "optim": osd}
    if edit is not None:
        edit(state)
    dcp.save(state, checkpoint_id=run / "checkpoints" / name, no_dist=True)
    torch.save({**ck, "model": {}, "optimizer": {}, "sharded": name}, run / "checkpoints" / "last.pt")
    return name
