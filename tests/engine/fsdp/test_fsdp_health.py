"""Run health under fsdp (issues 32 and 36): per-layer health summed from each rank's shards, the
noise scale from each rank's gradient at the reduce-scatter, and where a NaN began, replayed on every
rank. Real fsdp launches (2 ranks, Gloo, float64) compared with the single-process engine."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from fsdp_helpers import KINDS, launch, run_dirs, settings, single_process
from helpers import TASK_FILES
from multilane.engine.config import build_config
from multilane.engine.run.trainer import Trainer
from multilane.engine.rundir.runlog import read_metrics
from multilane.engine.tasks import make_task

pytestmark = pytest.mark.timeout(600)

QUANTITIES = ("grad_norm", "weight_norm", "update_ratio", "act_mean", "act_std", "act_zero")


def same(a: float | None, b: float | None) -> bool:
    """Equal as the records write them (4 significant digits): at most one unit in the last digit
    apart, where two values a rounding error apart fall either side of a rounding boundary."""
    if a is None or b is None:
        return a is b
    ulp = 10 ** (math.floor(math.log10(abs(b))) - 3) if b else 0.0
    return abs(a - b) <= 1.01 * ulp


def assert_same(got: dict, want: dict, keys: tuple[str, ...], what: str) -> None:
    for key in keys:
        assert len(got[key]) == len(want[key]), (what, key)
        for a, b in zip(got[key], want[key], strict=True):
            assert same(a, b), f"{what}: {key} {got[key]} != {want[key]}"


def of_kind(records: list[dict], kind: str) -> list[dict]:
    return [r for r in records if r["kind"] == kind]


def in_process(tmp_path: Path, cfg: dict, devices: dict, name: str) -> list[dict]:
    cfg = {**cfg, "devices": devices, "run": {"runs_dir": str(tmp_path / name), "name": name}}
    result = Trainer(build_config(cfg), task=make_task(KINDS, cfg["task"]["params"])).run()
    assert result.status == "finished", result.message
    return read_metrics(result.run_dir)


@pytest.mark.slow
def test_fsdp_health_equals_one_devices_and_the_noise_scale_two_lanes(tmp_path):
    # The hidden-layer MLP on 2 ranks with uneven shares [1, 3], two micro-batches a step, clipping.
    cfg = settings("mlp", 3, "cpu:0,cpu:1", weights=[1, 3])
    cfg["health"] = {"every": 1, "activations": "GELU", "noise_decay": 0.5}
    cfg["train"]["eval_every"] = 0
    launch(tmp_path, cfg)
    (run,) = run_dirs(tmp_path / "runs")
    mine = read_metrics(run)
    _, ref, ref_run = single_process(tmp_path, cfg, "one")
    got, want = of_kind(mine, "health"), of_kind(ref, "health")
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3]
    for g, w in zip(got, want, strict=True):
        assert g["rows"] == w["rows"] == ["0", "2", "4"] and g["act_rows"] == w["act_rows"]
        assert len(g["act_rows"]) == 2 and all(g[k] for k in QUANTITIES)
        assert_same(g, w, QUANTITIES, f"step {g['step']}")
    full = [json.loads(x) for x in (run / "health_layers.jsonl").read_text().splitlines()]
    ref_full = [json.loads(x) for x in (ref_run / "health_layers.jsonl").read_text().splitlines()]
    for g, w in zip(full, ref_full, strict=True):
        assert g["names"] == w["names"]
        assert_same(g, w, QUANTITIES, f"health_layers step {g['step']}")
    # The noise scale: each rank's gradient is a lane's; 2 lanes with the same shares estimate the same.
    lanes = in_process(tmp_path, cfg, {"use": "cpu:0,cpu:1", "weights": [1, 3]}, "lanes")
    noise = [r["noise"] for r in of_kind(mine, "train") if not r.get("partial")]
    ref_noise = [r["noise"] for r in of_kind(lanes, "train")]
    assert len(noise) == len(ref_noise) == 3
    for g, w in zip(noise, ref_noise, strict=True):
        assert g["batch"] == w["batch"] and g["unit"] == w["unit"] == "loss weight"
        assert all(same(g[k], w[k]) for k in ("g2", "trace", "b_simple")), (g, w)


# -- where a NaN began --------------------------------------------------------------------------------
NAN_TASK = str(TASK_FILES / "nan_sources.py")


def nan_settings(tmp_path: Path, devices: dict, params: dict, name: str) -> dict:
    return {
        "task": {"name": NAN_TASK, "params": params},
        "data": {"batch_size": 24, "val_fraction": 0.0},
        "optim": {"name": "sgd", "lr": 0.01},
        "train": {"steps": 10, "log_every": 10, "eval_every": 0},
        "devices": devices,
        "telemetry": {"enabled": False},
        "run": {"runs_dir": str(tmp_path / name), "name": name},
    }


@pytest.mark.slow
def test_fsdp_names_where_a_nan_began_as_the_single_process_engine(tmp_path):
    import re
    import subprocess

    from helpers import CLI

    params = {"how": "zero_input", "bad": 61}
    cfg = nan_settings(tmp_path, {"use": "cpu:0,cpu:1", "strategy": "fsdp"}, params, "fsdp")
    path = tmp_path / "fsdp.json"
    path.write_text(json.dumps(cfg))
    r = subprocess.run([*CLI, "train", "--config", str(path)], capture_output=True, text=True, timeout=300)
    (run,) = [p for p in (tmp_path / "fsdp").iterdir() if (p / "status.json").is_file()]
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "stopped", r.stderr[-3000:]
    line, detail = status["message"], json.loads((run / "nan_origin.json").read_text())
    ref = nan_settings(tmp_path, {"use": "cpu:0,cpu:1"}, params, "lanes")
    result = Trainer(build_config(ref), task=make_task(NAN_TASK, params)).run()
    assert result.status == "stopped", result.message
    want = json.loads((result.run_dir / "nan_origin.json").read_text())

    def as_lanes(text: str) -> str:  # a rank's name (host/rank1/cpu:1) as the lane with its shard
        return re.sub(r"[^\s/]+/rank\d+/(cpu:\d+)", r"\1", text)

    assert as_lanes(line) == result.message
    assert detail["step"] == want["step"] and detail["samples"] == want["samples"] == [params["bad"]]
    assert detail["kind"] == want["kind"] == "output"
    for part in ("inputs", "outputs", "gradients"):
        assert {as_lanes(k): v for k, v in detail[part].items()} == want[part], part
    assert len(detail["device_loss"]) == 2
