"""bench/gpu_check.py, the one call a lent GPU gets: its CPU dry run passes in CI, so the check never rots.

The dry run is the real script as a subprocess (CPU lanes where the GPU run has cuda:0, Gloo for ddp);
the GPU-only checks (NVML, out of memory, TFLOP/s against the card's peak) are skipped and say so.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.py"


def load_driver():
    spec = importlib.util.spec_from_file_location("gpu_check_driver", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # puts bench/gpu_checks on sys.path, as the script does
    return module


@pytest.mark.slow
@pytest.mark.timeout(960)
def test_the_dry_run_passes_every_check_it_runs_and_writes_the_json_under_out(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=940,
        env={**os.environ, "OUT": str(out)},
        cwd=tmp_path,
    )
    report = json.loads((out / "gpu_check.json").read_text())
    rows = [row for check in report["checks"] for row in check["rows"]]
    failed = [row for row in rows if row["status"] == "fail"]
    assert r.returncode == 0 and not failed, (failed, r.stdout[-3000:], r.stderr[-3000:])
    assert report["mode"] == "dry-run"
    assert [c["name"] for c in report["checks"]] == list(load_driver().CHECKS)
    by_check = {c["name"]: c["rows"] for c in report["checks"]}
    for gpu_only in ("telemetry", "out of memory"):
        assert [row["status"] for row in by_check[gpu_only]] == ["skip"]
    # Every strategy was checked against the hand loop, on one lane and on two.
    for strategy in ("replicate", "persistent"):
        cases = {row["case"] for row in by_check[f"correctness {strategy}"] if row["status"] == "pass"}
        for model in ("mlp", "batchnorm", "dropout"):
            for precision in ("fp32", "bf16"):
                assert {f"{model} {precision} [cpu:0]", f"{model} {precision} [cpu:0,cpu:1]"} <= cases
    assert [row["status"] for row in by_check["correctness ddp"] if row["case"] == "mlp fp32 [cpu:0,cpu:1] Gloo"] == [
        "pass"
    ]
    fsdp = [row["status"] for row in by_check["correctness fsdp"] if row["case"] == "mlp fp32 [cpu:0,cpu:1] Gloo"]
    assert fsdp == ["pass"]
    speed = {row["case"]: row for row in by_check["speed"]}
    assert speed["mlp 4x256 [cpu:0,cpu:1] DDP (Gloo, 2 processes)"]["status"] == "pass"
    fsdp = speed["mlp 4x256 [cpu:0,cpu:1] FSDP2 (Gloo, 2 processes)"]  # fsdp's step beside ddp's
    assert fsdp["status"] == "pass" and fsdp["data"]["step_s"] > 0, fsdp
    assert speed["mlp 4x256 [cpu:0,cpu:1] replicate"]["data"]["vs_data_parallel"] > 0
    # The table is printed at the end, as the device tool's reply shows the end of the output.
    assert "gpu_check (dry run on CPU lanes)" in r.stdout


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_check_past_its_timeout_is_a_failed_row_and_its_processes_are_gone(tmp_path):
    driver = load_driver()
    result = driver.run_check("speed", True, tmp_path, timeout=3)
    (last,) = [row for row in result["rows"] if row["case"] == "(the check itself)"]
    assert last["status"] == "fail" and last["measured"] == "timed out after 3 s"
    leftovers = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if str(tmp_path) in cmd:
            leftovers.append(cmd)
    assert not leftovers


def test_the_tolerances_tell_a_wrong_result_from_rounding(tmp_path):
    load_driver()
    from common import TOLERANCE, engine_in_process, hand_loop, rel_diff, run_config, task_params

    ref = hand_loop(task_params("batchnorm"), "fp32", torch.device("cpu"))
    right = run_config(task_params("batchnorm"), "cpu:0,cpu:1", "replicate", "fp32", tmp_path)
    wrong = run_config(
        task_params("batchnorm"), "cpu:0,cpu:1", "replicate", "fp32", tmp_path, devices__sync_batchnorm=False
    )
    _, _, got_right = engine_in_process(right)
    _, _, got_wrong = engine_in_process(wrong)
    assert rel_diff(got_right, ref) <= TOLERANCE["fp32"]
    # BatchNorm over each half of the batch instead of the whole: caught even at bf16's bound.
    assert rel_diff(got_wrong, ref) > TOLERANCE["bf16"] > TOLERANCE["fp32"]


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H200", 989.0),
        ("NVIDIA H200 NVL", 835.0),
        ("NVIDIA H100 80GB HBM3", 989.0),  # how nvidia-smi names the SXM part
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA GeForce GTX 1080", None),  # not in the table: TFLOP/s without a share of peak
    ],
)
def test_the_cards_bf16_rate_is_read_from_its_name(name, peak):
    load_driver()
    from environment import bf16_peak

    assert bf16_peak(name) == peak


def test_nvidia_smi_readings_that_are_not_numbers_are_left_out_not_zero():
    load_driver()
    from environment import parse_smi_line
    from telemetry import SMI_FIELDS, compare, number

    line = "97, 40321, 143771, 51, [N/A], 700.00, 1980"
    values = dict(zip(SMI_FIELDS, parse_smi_line(line), strict=True))
    assert number(values["power_w"]) is None
    assert number(values["mem_total_mb"]) == 143771.0
    assert compare("mem_total_mb", 143771.0, 143771.0) and not compare("mem_total_mb", 143771.0, 143000.0)
    assert compare("power_w", 500.0, 450.0) and not compare("power_w", 500.0, 300.0)
