"""A ddp or fsdp rank on a process group of one (the fast tier runs every module at least once).
The launches of several ranks (test_ddp_exact, test_fsdp_exact, test_nan_origin_ddp) are slow: each starts
a launcher and its ranks. Here ``rank_main`` — the rank's entry point, as the launcher's forked rank calls
it — trains on a Gloo group of one on 127.0.0.1 in one process forked from the suite's pre-imported
server (rank_of_one.py; about a second), so the rank's trainer, its loader slice, its log window, its
evaluation, its telemetry and its NaN replay run, and must give what the single-process engine gives on
one lane, in float64: every logged loss and validation loss, the final parameters, where a NaN began.

Not in the test's own process: a process group leaves Gloo's and the TCP store's threads behind when it
is destroyed, and a DataLoader worker forked after them hung (3 runs in 8 under load) — a hazard for
every later test of the same pytest worker."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import TASK_FILES
from multilane.engine.config import build_config
from multilane.engine.run.trainer import Trainer
from multilane.engine.rundir.runlog import read_metrics
from multilane.engine.tasks import make_task

HERE = Path(__file__).resolve().parent
FLOAT64 = str(TASK_FILES / "float64_dataset.py")
NAN = str(TASK_FILES / "nan_sources.py")


def run_rank(tmp_path: Path, cfg: dict) -> int:
    """``rank_main`` of rank 0 of 1 on ``cfg``, in a process of its own; its exit status."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("MULTILANE_RUN_DIR", "MULTILANE_NODE_FILE")}
    env |= {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    path = tmp_path / "rank.json"
    path.write_text(json.dumps(cfg))
    r = subprocess.run([sys.executable, str(HERE / "rank_of_one.py"), str(path)], env=env, capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    return r.returncode


def settings(tmp_path: Path, name: str, task: str, params: dict, strategy: str | None, **train) -> dict:
    devices = {"use": "cpu:0"} | ({"strategy": strategy} if strategy else {})
    return {
        "task": {"name": task, "params": params},
        "data": {"batch_size": 16, "val_fraction": 0.25},
        "optim": {"name": "adam", "lr": 0.01},
        "train": {"steps": 6, "log_every": 1, "eval_every": 3, "seed": 4} | train,
        "devices": devices,
        "telemetry": {"enabled": False},
        "run": {"runs_dir": str(tmp_path / name), "name": name},
    }


def the_run(runs: Path) -> Path:
    (run,) = [p for p in runs.iterdir() if (p / "status.json").is_file()]
    return run


def losses(records: list[dict]) -> list[tuple]:
    return [(r["step"], r.get("loss"), r.get("val_loss")) for r in records if "loss" in r or "val_loss" in r]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_rank_of_one_trains_as_the_single_process_engine_on_one_lane(tmp_path, strategy):
    params = {"kind": "map"}
    ref_cfg = settings(tmp_path, "ref", FLOAT64, params, None)
    ref = Trainer(build_config(ref_cfg), task=make_task(FLOAT64, params))
    result = ref.run()
    assert result.status == "finished", result.message

    assert run_rank(tmp_path, settings(tmp_path, "rank", FLOAT64, params, strategy)) == 0
    run = the_run(tmp_path / "rank")
    assert json.loads((run / "status.json").read_text())["state"] == "finished"
    got, want = losses(read_metrics(run)), losses(read_metrics(result.run_dir))
    assert len(got) == len(want) > 6 and any(v is not None for _, _, v in got)  # train and validation lines
    for (s1, l1, v1), (s2, l2, v2) in zip(got, want, strict=True):
        assert s1 == s2
        for a, b in ((l1, l2), (v1, v2)):
            assert (a is None) == (b is None) and (a is None or abs(a - b) <= 1e-10 * max(1.0, abs(b))), (s1, a, b)
    saved = torch.load(run / "checkpoints" / "last.pt", weights_only=True) if strategy == "ddp" else None
    if saved is not None:  # the rank's checkpoint holds the weights the one lane ended with
        for k, v in ref.model.state_dict().items():
            assert torch.allclose(saved["model"][k], v, rtol=0, atol=1e-10), k


def test_a_nan_on_a_rank_of_one_is_traced_to_the_module_and_samples_the_one_lane_names(tmp_path):
    params = {"how": "zero_input", "bad": 61}
    ref = settings(tmp_path, "ref", NAN, params, None, steps=10, log_every=10, eval_every=0)
    ref["data"]["val_fraction"] = 0.0
    ref["optim"] = {"name": "sgd", "lr": 0.01}
    result = Trainer(build_config(ref), task=make_task(NAN, params)).run()
    assert result.status == "diverged" and "first non-finite" in result.message, result.message

    cfg = {
        **ref,
        "devices": {"use": "cpu:0", "strategy": "ddp"},
        "run": {"runs_dir": str(tmp_path / "rank"), "name": "r"},
    }
    assert run_rank(tmp_path, cfg) == 0  # diverged, not failed: the launcher maps it to exit 3
    run = the_run(tmp_path / "rank")
    status = json.loads((run / "status.json").read_text())
    want = json.loads((result.run_dir / "nan_origin.json").read_text())
    got = json.loads((run / "nan_origin.json").read_text())
    assert status["state"] == "diverged" and as_lane(status["message"]) == result.message, status["message"]
    assert got["step"] == want["step"] and got["samples"] == want["samples"] == [61] and got["kind"] == "output"
    for part in ("inputs", "outputs", "gradients"):
        assert {as_lane(k): v for k, v in got[part].items()} == want[part], part


def as_lane(text: str) -> str:
    """A rank's name (host/rank0/cpu:0) as the lane that took the same shard (cpu:0)."""
    return re.sub(r"[^\s/]+/rank\d+/(cpu:\d+)", r"\1", text)
