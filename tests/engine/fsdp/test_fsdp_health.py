"""Run health under fsdp: per-layer health summed from each rank's shards, the
noise scale from each rank's gradient at the reduce-scatter, and where a NaN began, replayed on every
rank. Real fsdp launches (2 ranks, Gloo, float64) compared with the single-process engine."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from fsdp_helpers import KINDS, launch, run_dirs, settings, single_process
from helpers import TASK_FILES
from multilane.engine.config import build_config
from multilane.engine.fsdp.units import default_units, shard_model
from multilane.engine.health.layers import LayerSample
from multilane.engine.run.trainer import Trainer
from multilane.engine.rundir.runlog import read_metrics
from multilane.engine.tasks import make_task
from multilane.engine.tasks.charlm import ByteGPT, CharLMParams

pytestmark = pytest.mark.timeout(600)

QUANTITIES = ("grad_norm", "weight_norm", "update_ratio", "act_mean", "act_std", "act_zero")


def same(a: float | None, b: float | None) -> bool:
    """Equal as the records write them (4 significant digits): at most one unit in the last digit
    apart, where two values a rounding error apart fall either side of a rounding boundary; or both
    float64 round-off around 0 (a LayerNorm's output mean)."""
    if a is None or b is None:
        return a is b
    ulp = 10 ** (math.floor(math.log10(abs(b))) - 3) if b else 0.0
    return abs(a - b) <= max(1.01 * ulp, 1e-14)


def assert_same(got: dict, want: dict, keys: tuple[str, ...], what: str) -> None:
    for key in keys:
        assert len(got[key]) == len(want[key]), (what, key)
        for a, b in zip(got[key], want[key], strict=True):
            assert same(a, b), f"{what}: {key} {got[key]} != {want[key]}"


def of_kind(records: list[dict], kind: str) -> list[dict]:
    return [r for r in records if r["kind"] == kind]


def test_a_recomputed_unit_counts_its_activations_once_and_a_unit_keeps_its_kind(tmp_path):
    # One process: a transformer sharded with each block recomputed in backward. The activation
    # hooks find the LayerNorm that became a unit (its class is now FSDPLayerNorm), count each
    # output once (not again when backward recomputes the block), and the per-layer gradient sums
    # from the shards equal an unsharded copy's.
    torch.manual_seed(0)
    model = ByteGPT(CharLMParams(context=8, layers=2, heads=2, width=8, dropout=0.0)).double()
    plain = copy.deepcopy(model)
    x = torch.randint(0, 256, (3, 8))
    plain(x).square().mean().backward()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        shard_model(model, default_units(model), "fp32", activation_checkpointing=True)
        sample = LayerSample(model, ["GELU", "LayerNorm"], torch.device("cpu"), always_act=True)
        assert ("ln", "LayerNorm") in sample.act_names and ("blocks.0.mlp.1", "GELU") in sample.act_names
        handles = sample.hook_activations([model])
        model(x).square().mean().backward()
        for h in handles:
            h.remove()
        sample.gradients(None)
        counts = sample.tensors()["act"][:, 3].tolist()
        widths = {"GELU": 4 * 8, "LayerNorm": 8}
        assert counts == [3 * 8 * widths[kind] for _, kind in sample.act_names]
        ref = LayerSample(plain, [], torch.device("cpu"))
        ref.gradients(None)
        assert sample.names == ref.names
        assert torch.allclose(sample.grad_sq, ref.grad_sq, rtol=1e-12, atol=0)
    finally:
        dist.destroy_process_group()


def in_process(tmp_path: Path, cfg: dict, devices: dict, name: str) -> list[dict]:
    cfg = {**cfg, "devices": devices, "run": {"runs_dir": str(tmp_path / name), "name": name}}
    result = Trainer(build_config(cfg), task=make_task(KINDS, cfg["task"]["params"])).run()
    assert result.status == "finished", result.message
    return read_metrics(result.run_dir)


CASES = {
    # the hidden-layer MLP, uneven shares [1, 3]
    "mlp [1, 3]": ("mlp", {"weights": [1, 3]}, "GELU", ["0", "2", "4"]),
    # the same under ddp: each rank's activations are its own shard's, summed over the ranks as fsdp's
    "mlp [1, 3], ddp": ("mlp", {"weights": [1, 3], "strategy": "ddp"}, "GELU", ["0", "2", "4"]),
    # the charlm transformer (6 units, token-weighted loss), each block recomputed in backward. Its
    # activations are not one device's: each rank pads its own shard to its own longest line, one
    # device the whole batch to the batch's (docs/fsdp.md "Run health"); its parameters' values are.
    "charlm, activation checkpointing": (
        "charlm",
        {"fsdp_activation_checkpointing": True},
        "GELU,LayerNorm",
        ["tok", "pos", "blocks.0", "blocks.1", "ln", "head"],
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_fsdp_and_ddp_health_equal_one_devices_and_the_noise_scale_two_lanes(tmp_path, case):
    # 2 ranks, two micro-batches a step, gradient clipping (the records hold the gradient before it).
    kind, more, kinds, rows = CASES[case]
    more = dict(more)
    cfg = settings(kind, 3, "cpu:0,cpu:1", more.pop("strategy", "fsdp"), **more)
    cfg["health"] = {"every": 1, "activations": kinds, "noise_decay": 0.5, "groups": 6}
    cfg["train"]["eval_every"] = 0
    launch(tmp_path, cfg)
    (run,) = run_dirs(tmp_path / "runs")
    mine = read_metrics(run)
    _, ref, ref_run = single_process(tmp_path, cfg, "one")
    got, want = of_kind(mine, "health"), of_kind(ref, "health")
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3]
    for g, w in zip(got, want, strict=True):
        assert g["rows"] == w["rows"] == rows and g["act_rows"] == w["act_rows"]
        assert len(g["act_rows"]) >= 2 and all(g[k] for k in QUANTITIES)
        assert_same(g, w, QUANTITIES if kind != "charlm" else QUANTITIES[:3], f"step {g['step']}")
    full = [json.loads(x) for x in (run / "health_layers.jsonl").read_text().splitlines()]
    ref_full = [json.loads(x) for x in (ref_run / "health_layers.jsonl").read_text().splitlines()]
    for g, w in zip(full, ref_full, strict=True):
        assert g["names"] == w["names"]
        assert_same(g, w, QUANTITIES if kind != "charlm" else QUANTITIES[:3], f"health_layers step {g['step']}")
    # The noise scale: each rank's gradient is a lane's; 2 lanes with the same shares estimate the same.
    lanes = in_process(tmp_path, cfg, {"use": "cpu:0,cpu:1", "weights": cfg["devices"]["weights"]}, "lanes")
    noise = [r["noise"] for r in of_kind(mine, "train") if not r.get("partial")]
    ref_noise = [r["noise"] for r in of_kind(lanes, "train")]
    assert len(noise) == len(ref_noise) == 3
    for g, w in zip(noise, ref_noise, strict=True):
        assert g["batch"] == w["batch"] and g["unit"] == w["unit"] == "loss weight"  # targets (tokens)
        assert all(same(g[k], w[k]) for k in ("g2", "trace", "b_simple")), (g, w)


# -- where a NaN began --------------------------------------------------------------------------------
NAN_TASK = str(TASK_FILES / "nan_sources.py")


def nan_settings(tmp_path: Path, devices: dict, params: dict, name: str) -> dict:
    return {
        "task": {"name": NAN_TASK, "params": params},
        "data": {"batch_size": 24, "val_fraction": 0.0},
        "optim": {"name": "sgd", "lr": 0.01},
        "train": {"steps": 10, "log_every": 10, "eval_every": 0, "grad_accum": 2},
        "devices": devices,
        "telemetry": {"enabled": False},
        "run": {"runs_dir": str(tmp_path / name), "name": name},
    }


@pytest.mark.slow
def test_fsdp_names_where_a_nan_began_as_the_single_process_engine(tmp_path):
    import re
    import subprocess

    from helpers import CLI

    # sample 32: step 1's 2nd micro-batch (of 2 accumulated), row 20, the second rank's shard
    params = {"how": "zero_input", "bad": 32}
    cfg = nan_settings(tmp_path, {"use": "cpu:0,cpu:1", "strategy": "fsdp"}, params, "fsdp")
    path = tmp_path / "fsdp.json"
    path.write_text(json.dumps(cfg))
    r = subprocess.run([*CLI, "train", "--config", str(path)], capture_output=True, text=True, timeout=300)
    (run,) = [p for p in (tmp_path / "fsdp").iterdir() if (p / "status.json").is_file()]
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "diverged" and r.returncode == 3, r.stderr[-3000:]
    line, detail = status["message"], json.loads((run / "nan_origin.json").read_text())
    ref = nan_settings(tmp_path, {"use": "cpu:0,cpu:1"}, params, "lanes")
    result = Trainer(build_config(ref), task=make_task(NAN_TASK, params)).run()
    assert result.status == "diverged", result.message
    want = json.loads((result.run_dir / "nan_origin.json").read_text())

    def as_lanes(text: str) -> str:  # a rank's name (host/rank1/cpu:1) as the lane with its shard
        return re.sub(r"[^\s/]+/rank\d+/(cpu:\d+)", r"\1", text)

    assert as_lanes(line) == result.message
    assert detail["step"] == want["step"] and detail["samples"] == want["samples"] == [params["bad"]]
    assert detail["kind"] == want["kind"] == "output" and detail["micro_batch"] == want["micro_batch"] == 1
    assert " on cpu:1, from samples 32;" in result.message
    for part in ("inputs", "outputs", "gradients"):
        assert {as_lanes(k): v for k, v in detail[part].items()} == want[part], part
    assert len(detail["device_loss"]) == 2
