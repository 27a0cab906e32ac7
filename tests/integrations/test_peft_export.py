"""``multilane export RUN --adapter DIR / --merged DIR``: the run's final LoRA model as a PEFT adapter folder
and as a merged ``save_pretrained`` model, each giving the run's logits (float64); bad input is one line and
writes nothing."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
from helpers import TASK_FILES, finished_linear_run
from multilane.engine.cli.main import main
from multilane.engine.config import build_config
from multilane.engine.integrations.peft_export import target_problem
from multilane.engine.run.trainer import Trainer

LORA = str(TASK_FILES / "lora_llama.py")


def test_an_export_target_must_be_a_new_or_empty_folder(tmp_path, capsys):
    assert target_problem("--adapter", tmp_path / "new") is None
    (tmp_path / "empty").mkdir()
    assert target_problem("--adapter", tmp_path / "empty") is None
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    assert "exists and is not empty" in target_problem("--merged", tmp_path / "full")
    (tmp_path / "file").write_text("x")
    assert "exists and is not a folder" in target_problem("--adapter", tmp_path / "file")
    assert "parent folder" in target_problem("--adapter", tmp_path / "no" / "such")
    assert main(["export", str(tmp_path)]) == 2
    assert "--adapter DIR or --merged DIR" in capsys.readouterr().err


def _lora_module():
    spec = importlib.util.spec_from_file_location("lora_llama_export", LORA)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("export")
    _lora_module().make_base(tmp / "base")
    cfg = {
        "task": {"name": LORA, "params": {"model": str(tmp / "base"), "rank": 4, "targets": ["q_proj", "o_proj"]}},
        "data": {"batch_size": 6, "workers": 0},
        "optim": {"name": "adam", "lr": 0.02},
        "train": {"steps": 3, "log_every": 1, "seed": 2},
        "devices": {"use": "cpu:0,cpu:1"},
        "telemetry": {"enabled": False},
        "run": {"runs_dir": str(tmp / "runs"), "name": "lora"},
    }
    trainer = Trainer(build_config(cfg))
    assert trainer.run().status == "finished"
    ids = torch.randint(0, 96, (3, 10), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        logits = trainer.model.eval()(ids)
    return tmp, trainer.run_dir.path, ids, logits


def leftovers(folder: Path) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.endswith(".tmp"))


@pytest.mark.slow
def test_the_exported_adapter_and_merged_model_give_the_runs_logits(lora_run, tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tmp, run, ids, want = lora_run
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    assert main(["export", str(run), "--adapter", str(adapter), "--merged", str(merged)]) == 0
    assert capsys.readouterr().out.split() == [str(adapter), str(merged)]
    assert (adapter / "adapter_config.json").is_file() and not (adapter / "config.json").exists()
    base = AutoModelForCausalLM.from_pretrained(tmp / "base", dtype=torch.float64, attn_implementation="eager")
    loaded = PeftModel.from_pretrained(base, adapter).eval()
    with torch.no_grad():
        got = loaded(input_ids=ids).logits
        whole = AutoModelForCausalLM.from_pretrained(merged, attn_implementation="eager").eval()
        assert whole.dtype == torch.float64 and not any("lora" in k for k in whole.state_dict())
        got_merged = whole(input_ids=ids).logits
    assert got.dtype == torch.float64 and torch.equal(got, want)  # the same computation, bit for bit
    assert float((got_merged - want).abs().max() / want.abs().max()) <= 1e-12
    assert leftovers(tmp_path) == []


@pytest.mark.slow
def test_bad_model_exports_are_one_line_and_write_nothing(lora_run, tmp_path, capsys):
    tmp, run, _, _ = lora_run
    full = tmp_path / "full"
    full.mkdir()
    (full / "mine.txt").write_text("keep")
    linear = finished_linear_run(tmp_path / "runs")
    cases = [
        (["--adapter", str(full)], run, f"--adapter {full} exists and is not empty"),
        (["--adapter", str(tmp_path / "a")], linear, "'s model (task linear) has no PEFT adapter"),
        (["--merged", str(tmp_path / "m")], linear, "(task linear) is not a Hugging Face model"),
        (["--adapter", str(tmp_path / "x"), "--merged", str(tmp_path / "x")], run, "name the same folder"),
        (["--adapter", str(tmp_path / "a")], tmp_path / "nothing", "is not a run folder"),
    ]
    for args, which, words in cases:
        capsys.readouterr()
        assert main(["export", str(which), *args]) == 2, words
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and words in err and "Traceback" not in err, err
    assert sorted(os.listdir(tmp_path)) == ["full", "runs"] and os.listdir(full) == ["mine.txt"]

    # The base changed on disk since the run: its adapter would be another model's; refused.
    _lora_module().make_base(tmp / "base", seed=7)
    try:
        assert main(["export", str(run), "--adapter", str(tmp_path / "a")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "this run's frozen weights differ" in err, err
        assert not (tmp_path / "a").exists() and leftovers(tmp_path) == []
    finally:
        _lora_module().make_base(tmp / "base", seed=0)
