"""What every check shares: the devices a mode runs on, the result rows, tolerances, and the hand loop.

A check is a function ``run(ctx) -> list[Row]`` in its own module; the driver (bench/gpu_check.py)
runs each in its own process with a timeout, so a crash, a hang or a CUDA error in one is recorded
and the others still run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

HERE = Path(__file__).resolve().parent
TASK_FILE = HERE / "task.py"
CLI = [sys.executable, "-m", "multilane.engine.cli"]

# Relative parameter difference after STEPS steps (``rel_diff``: ||a - b|| / ||b|| over the whole state).
# float32 lands near 1e-7 (a split batch sums in another order); bf16 autocast rounds each device's
# matrix products to 8 bits of mantissa, so a split batch lands near 1e-4 (7e-5 and 2e-4 measured on
# CPU lanes). Wrong results are larger: BatchNorm over each half of the batch instead of the whole
# (no sync_batchnorm) is 6e-3, two lanes' dropout masks against one device's 2e-2.
TOLERANCE = {"fp32": 1e-5, "bf16": 2e-3}
# Dropout with checkpointing against the same run without: the recompute must replay the same masks,
# so the two agree to float32 rounding whatever the precision.
RECOMPUTE_TOLERANCE = 1e-5
STEPS = 5
LR = 0.05
MOMENTUM = 0.9

PASS, FAIL, SKIP, INFO, KNOWN = "pass", "fail", "skip", "info", "known"
"""Row states: ``known`` is a failure an open issue already names (the row says which)."""


@dataclass
class Row:
    check: str
    case: str
    measured: str
    expected: str
    status: str
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class Context:
    """Where a check runs (``dry_run`` puts CPU lanes where the GPU run has cuda:0), and where its rows go:
    ``add`` writes every row to ``result`` at once, so a check stopped by its timeout keeps what it did."""

    dry_run: bool
    workdir: Path
    result: Path | None = None
    rows: list[Row] = field(default_factory=list)

    started: float = field(default_factory=time.monotonic)

    def add(self, row: Row) -> None:
        row.data.setdefault("at_s", round(time.monotonic() - self.started, 1))  # when, in the check's time
        self.rows.append(row)
        if self.result is not None:  # whole or not at all: a kill mid-write leaves the previous file
            tmp = self.result.with_suffix(".tmp")
            tmp.write_text(json.dumps({"rows": rows_json(self.rows)}))
            os.replace(tmp, self.result)

    @property
    def one(self) -> str:
        return "cpu:0" if self.dry_run else "cuda:0"

    @property
    def two(self) -> str:
        return "cpu:0,cpu:1" if self.dry_run else "cuda:0,cuda:0"

    @property
    def device(self) -> torch.device:
        return torch.device("cpu" if self.dry_run else "cuda:0")

    def device_lists(self) -> list[str]:
        return [self.one, self.two]


def precise_math() -> None:
    """float32 means float32: TF32 off for matrix products and cuDNN, so the fp32 tolerance holds."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The relative difference of two states (``b`` the reference): ||a - b|| / ||b|| over every floating
    parameter and buffer together. A per-tensor maximum would be noise: a bias that training drives
    through zero (the last layer's, here) has a tiny norm, and bf16 rounding alone is 1e-2 of it."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    num = den = 0.0
    for k, ref in b.items():
        if ref.is_floating_point():
            ref = ref.detach().double().cpu()
            num += (a[k].detach().double().cpu() - ref).pow(2).sum().item()
            den += ref.pow(2).sum().item()
    return (num / max(den, 1e-300)) ** 0.5


def state_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def task_params(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, **extra}


def hand_loop(params: dict[str, Any], precision: str, device: torch.device, steps: int = STEPS) -> dict:
    """One device, the whole batch, the loop a user writes: the reference of every correctness row."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    import task as check_task  # the same file the engine loads

    p = check_task.Params(**params)
    model = check_task.build(p).to(device)
    x, y = (t.to(device) for t in check_task.dataset(p.samples))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for _ in range(steps):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            out = model(x)
        loss = F.mse_loss(out.float(), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return state_of(model)


def run_config(params: dict[str, Any], devices: str, strategy: str, precision: str, runs: Path, **more: Any) -> dict:
    """The engine's config for the same training as ``hand_loop``: every step takes the whole data set."""
    samples = params.get("samples", 96)
    cfg: dict[str, Any] = {
        "task": {"name": str(TASK_FILE), "params": params},
        "devices": {"use": devices, "strategy": strategy, "sync_batchnorm": params.get("model") == "batchnorm"},
        "data": {"batch_size": samples, "val_fraction": 0.0},
        "optim": {"name": "sgd", "lr": LR, "momentum": MOMENTUM},
        "train": {
            "steps": STEPS,
            "precision": precision,
            "log_every": STEPS,
            "eval_every": 0,
            "checkpoint_minutes": 0.0,
        },
        "telemetry": {"enabled": False},
        "run": {"runs_dir": str(runs)},
    }
    for dotted, value in more.items():
        section, key = dotted.split("__")
        cfg.setdefault(section, {})[key] = value
    return cfg


def engine_in_process(cfg: dict[str, Any]) -> tuple[str, str, dict[str, torch.Tensor] | None]:
    """Train ``cfg`` with the engine's Trainer in this process: (status, message, final state)."""
    from multilane.engine import Trainer, build_config, make_task

    config = build_config(cfg)
    trainer = Trainer(config, task=make_task(config.task.name, config.task.params))
    result = trainer.run()
    state = state_of(trainer.model) if result.status == "finished" else None
    return result.status, result.message or "", state


def engine_ddp(cfg: dict[str, Any], workdir: Path, timeout: float = 240) -> tuple[str, str, dict | None]:
    """Train ``cfg`` as ``multilane train --strategy ddp`` (the user's path: a launcher and a process per
    device): (status, message, final state from the run's last checkpoint)."""
    runs = Path(cfg["run"]["runs_dir"])
    with tempfile.NamedTemporaryFile("w", suffix=".json", dir=workdir, delete=False) as f:
        json.dump(cfg, f)
    before = set(runs.glob("*")) if runs.exists() else set()
    r = subprocess.run([*CLI, "train", "--config", f.name], capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        lines = [ln for ln in (r.stderr or r.stdout).strip().splitlines() if ln.strip()]
        return "failed", lines[-1] if lines else f"exit {r.returncode}", None
    (run,) = [p for p in runs.glob("*") if p not in before and p.is_dir()]
    from multilane.engine.fsdp.sharded import read_model_state  # fsdp's checkpoint is sharded

    return "finished", "", {k: v.clone() for k, v in read_model_state(run).items()}


def fmt(x: float) -> str:
    return f"{x:.1e}"


def rows_json(rows: list[Row]) -> list[dict[str, Any]]:
    return [asdict(r) for r in rows]
