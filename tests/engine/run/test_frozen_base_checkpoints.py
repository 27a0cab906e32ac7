"""A model with frozen weights (a pretrained base under LoRA adapters) checkpoints its trainable state and
the optimizer only, names its base by source and hash, resumes exactly on every strategy that saves, and
refuses in one line to resume over a changed base."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import CLI, TASK_FILES
from multilane.engine.cli.main import main
from multilane.engine.config import build_config
from multilane.engine.errors import UserError
from multilane.engine.run.trainer import Trainer
from multilane.engine.rundir.runlog import read_metrics
from multilane.engine.tensors import frozen
from torch import nn

LORA = str(TASK_FILES / "lora_llama.py")


def make_base(folder: Path, seed: int = 0) -> None:
    spec = importlib.util.spec_from_file_location("lora_llama_file", LORA)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.make_base(folder, seed)


BOUND = 1e-10


def test_frozen_parameters_are_named_by_hash_not_saved_and_a_changed_base_is_refused_in_one_line():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)).double()
    model[0].requires_grad_(False)
    part = frozen.checkpoint_model_state(model, "base/folder")
    assert sorted(part["model"]) == sorted(k for k in model.state_dict() if not k.startswith("0."))
    base = part["frozen_base"]
    assert base["source"] == "base/folder" and base["tensors"] == 2 and base["bytes"] == (32 + 8) * 8
    assert frozen.base_fingerprint(model)["sha256"] == base["sha256"]  # cached, and still right

    torch.manual_seed(1)
    other = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)).double()
    other[0].load_state_dict(model[0].state_dict())
    other[0].requires_grad_(False)
    frozen.check_base(other, base, "ck.pt")  # the same base bytes: accepted
    frozen.load_trainable(other, part["model"], base)
    assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), model.state_dict().values(), strict=True))

    with torch.no_grad():
        other[0].weight[0, 0] += 1e-12  # one number of the base changed
    with pytest.raises(UserError) as e:
        frozen.check_base(other, base, "ck.pt")
    assert "\n" not in str(e.value) and "base/folder" in str(e.value) and "frozen weights differ" in str(e.value)
    other[0].requires_grad_(True)
    with pytest.raises(UserError, match="has no frozen parameter"):
        frozen.check_base(other, base, "ck.pt")
    whole = frozen.checkpoint_model_state(other)
    assert whole["frozen_base"] is None and whole["model"].keys() == other.state_dict().keys()


def settings(base: Path, runs: Path, name: str, steps: int, strategy: str, devices: str, **params) -> dict:
    return {
        "task": {"name": LORA, "params": {"model": str(base), **params}},
        "data": {"batch_size": 6, "val_fraction": 0.25, "workers": 0},
        "optim": {"name": "adamw", "lr": 0.01, "weight_decay": 0.1},
        "train": {"steps": steps, "log_every": 1, "eval_every": 2, "seed": 5, "grad_clip": 0.5},
        "devices": {"use": devices, "strategy": strategy},
        "telemetry": {"enabled": False},
        "run": {"runs_dir": str(runs), "name": name},
    }


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    """The base folder and a straight 5-step run on one device (the reference)."""
    tmp = tmp_path_factory.mktemp("lora")
    make_base(tmp / "base")
    trainer = Trainer(build_config(settings(tmp / "base", tmp / "ref", "straight", 5, "replicate", "cpu:0")))
    result = trainer.run()
    assert result.status == "finished", result.message
    return tmp, trainer.model.state_dict(), read_metrics(result.run_dir)


def trainable(state: dict) -> dict:
    return {k: v for k, v in state.items() if "lora_" in k}


def assert_equal_to_straight(run: Path, ref_state: dict, ref_records: list[dict], what: str) -> None:
    from multilane.engine.fsdp.sharded import read_model_state

    mine = read_model_state(run)
    assert mine.keys() == trainable(ref_state).keys(), what  # the adapters only: nothing of the base
    for k, v in trainable(ref_state).items():
        diff = float((mine[k].double() - v.double()).abs().max() / v.abs().max())
        assert diff <= BOUND, f"{what}: {k} differs by {diff:.2e}"
    got = [(r["step"], r["loss"]) for r in read_metrics(run) if r["kind"] == "train" and not r.get("partial")]
    want = [(r["step"], r["loss"]) for r in ref_records if r["kind"] == "train"]
    assert [s for s, _ in got] == [s for s, _ in want], what
    for (step, a), (_, b) in zip(got, want, strict=True):
        assert abs(a - b) <= BOUND * abs(b), f"{what}: step {step} loss {a!r} != {b!r}"


@pytest.mark.slow
def test_lanes_stop_and_resume_over_a_frozen_base_equal_a_straight_run_and_a_changed_base_is_refused(
    lora, tmp_path, capsys
):
    tmp, ref_state, ref_records = lora
    base = Path(shutil.copytree(tmp / "base", tmp_path / "base"))  # changed on disk below
    stopped = Trainer(build_config(settings(base, tmp_path, "lanes", 2, "persistent", "cpu:0,cpu:1")))
    assert stopped.run().status == "finished"
    run = stopped.run_dir.path
    ck = torch.load(run / "checkpoints" / "last.pt", weights_only=True)
    assert ck["frozen_base"]["source"] == str(base) and ck["frozen_base"]["tensors"] == 21
    assert not any("lora_" not in k for k in ck["model"])  # trainable state only
    code = main(["train", "--resume", str(run), "--steps", "5", "--strategy", "replicate"])
    assert code == 0
    assert_equal_to_straight(run, ref_state, ref_records, "persistent(2) > replicate(2)")

    make_base(base, seed=1)  # the base folder rewritten: same shapes, other bytes
    capsys.readouterr()
    before = sorted(os.listdir(run / "checkpoints")), (run / "checkpoints" / "last.pt").read_bytes()
    assert main(["train", "--resume", str(run), "--steps", "6"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"was trained over the frozen base {base} (sha256 {ck['frozen_base']['sha256'][:12]}" in err
    assert (sorted(os.listdir(run / "checkpoints")), (run / "checkpoints" / "last.pt").read_bytes()) == before


@pytest.mark.slow
def test_lanes_then_fsdp_then_one_device_resume_over_a_frozen_base_equal_a_straight_run(lora, tmp_path):
    # Two lanes save the trainable state (as a ddp rank 0 does: the same function); fsdp on 2 ranks resumes
    # it into its sharded model (the frozen weights its own) and saves with DCP, without the base; one
    # device resumes from that folder. Every step's loss and the adapters equal 5 straight steps.
    tmp, ref_state, ref_records = lora
    first = Trainer(build_config(settings(tmp / "base", tmp_path / "runs", "mixed", 1, "replicate", "cpu:0,cpu:1")))
    assert first.run().status == "finished"
    run = first.run_dir.path
    args = ["--steps", "3", "--strategy", "fsdp", "--devices", "cpu:0,cpu:1"]
    r = subprocess.run([*CLI, "train", "--resume", str(run), *args], capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stderr[-3000:]
    ck = torch.load(run / "checkpoints" / "last.pt", weights_only=True)
    assert ck["sharded"] and ck["frozen_base"]["tensors"] == 21 and ck["frozen_base"]["source"] == str(tmp / "base")
    folder = run / "checkpoints" / ck["sharded"]
    shards = sum(f.stat().st_size for f in folder.iterdir())
    assert shards < 0.5 * ck["frozen_base"]["bytes"], (shards, ck["frozen_base"])  # no frozen weight in it
    # The sharded checkpoint exports as a PEFT adapter holding exactly its adapters.
    from multilane.engine.fsdp.sharded import read_model_state
    from safetensors.torch import load_file

    assert main(["export", str(run), "--adapter", str(tmp_path / "adapter")]) == 0
    exported = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    sharded = read_model_state(run)
    assert len(exported) == len(sharded) == 8
    for key, tensor in exported.items():
        assert torch.equal(tensor, sharded["lm." + key.replace(".weight", ".default.weight")]), key
    assert main(["train", "--resume", str(run), "--steps", "5", "--strategy", "replicate", "--devices", "cpu:0"]) == 0
    assert_equal_to_straight(run, ref_state, ref_records, "lanes(2) > fsdp(2) > one device")
