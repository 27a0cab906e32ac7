"""Where a NaN began, under ddp: every rank replays the log window together, each its
own shard, and the run names the same step, module (or the data), samples and gradient as the
single-process engine on as many lanes names for the same run — the rank that held the sample in place
of the lane, also in a later micro-batch of an accumulated step under uneven shares. Real ddp launches
(Gloo, one process per rank), compared with the in-process engine."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from helpers import CLI, TASK_FILES
from multilane.engine.config import build_config
from multilane.engine.run.trainer import Trainer
from multilane.engine.tasks import make_task

pytestmark = pytest.mark.timeout(600)
TASK = str(TASK_FILES / "nan_sources.py")
ACCUMULATED = 32
"""Position 44 of epoch 0's order (tests/engine/health/test_nan_origin_replays.py, ``at``): micro-batch 1
(step 1's second, with ``grad_accum`` 2), row 20, the second device's under shares 1:2."""


ACCUM = {"grad_accum": 2}  # the sample in a step's 2nd micro-batch, on the device with the larger share
SHARES = [1.0, 2.0]


def settings(tmp_path: Path, lanes: int, params: dict, name: str) -> dict:
    accum = params.get("bad") == ACCUMULATED
    return {
        "task": {"name": TASK, "params": params},
        "data": {"batch_size": 24, "val_fraction": 0.0},
        "optim": {"name": "sgd", "lr": 0.01},
        "train": {"steps": 10, "log_every": 10, "eval_every": 0, **(ACCUM if accum else {})},
        "devices": {"use": ",".join(f"cpu:{i}" for i in range(lanes)), **({"weights": SHARES} if accum else {})},
        "telemetry": {"enabled": False},
        "run": {"runs_dir": str(tmp_path / name), "name": name},
    }


def lanes_run(tmp_path: Path, lanes: int, params: dict) -> tuple[str, dict]:
    cfg = settings(tmp_path, lanes, params, "lanes")
    result = Trainer(build_config(cfg), task=make_task(TASK, params)).run()
    assert result.status == "diverged", result.message
    return result.message, json.loads((result.run_dir / "nan_origin.json").read_text())


def ddp_run(tmp_path: Path, ranks: int, params: dict) -> tuple[str, dict, dict]:
    cfg = settings(tmp_path, ranks, params, "ddp")
    path = tmp_path / "ddp.json"
    path.write_text(json.dumps(cfg))
    r = subprocess.run([*CLI, "train", "--strategy", "ddp", "--config", str(path)], capture_output=True, text=True,
                       timeout=300)  # fmt: skip
    (run,) = [p for p in (tmp_path / "ddp").iterdir() if (p / "status.json").is_file()]
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "diverged" and r.returncode == 3, r.stderr[-3000:]
    return status["message"], json.loads((run / "nan_origin.json").read_text()), status


def as_lanes(text: str) -> str:
    """A ddp rank's name (host/rank1/cpu:1) as the lane that took the same shard (cpu:1)."""
    return re.sub(r"[^\s/]+/rank\d+/(cpu:\d+)", r"\1", text)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("ranks", "params"),
    [(2, {"how": "zero_input", "bad": ACCUMULATED}), (3, {"how": "nan_data", "bad": 17})],
    ids=["inf-from-one-sample-2nd-micro-batch-uneven-2-ranks", "nan-in-the-data-3-ranks"],
)
def test_ddp_names_the_origin_the_single_process_engine_names(tmp_path, ranks, params):
    line, detail, status = ddp_run(tmp_path, ranks, params)
    want_line, want = lanes_run(tmp_path, ranks, params)
    assert as_lanes(line) == want_line and status["message"] == line
    assert detail["step"] == want["step"] and detail["samples"] == want["samples"] == [params["bad"]]
    assert detail["kind"] == want["kind"] == ("output" if params["how"] == "zero_input" else "input")
    for part in ("inputs", "outputs", "gradients"):
        assert {as_lanes(k): v for k, v in detail[part].items()} == want[part], part
    held = as_lanes(next(iter(detail["outputs"] or detail["inputs"])))
    assert f" on {held}" in as_lanes(line) and len(detail["device_loss"]) == ranks
    if params["bad"] == ACCUMULATED:  # the rank that held it in the step's 2nd micro-batch
        assert held == "cpu:1" and detail["step"] == 1 and detail["micro_batch"] == want["micro_batch"] == 1
