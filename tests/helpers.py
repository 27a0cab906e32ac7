"""Small tasks, models and a CLI launcher shared by the tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from multilane.engine.tasks import ArrayData, Task
from pydantic import BaseModel, Field
from torch import nn
from torch.nn import functional as F


class Float64Params(BaseModel):
    samples: int = Field(96, ge=2)


class Float64Task(Task):
    """Regression in float64, where data-parallel training must equal full-batch training to 1e-10."""

    name = "float64"
    Params = Float64Params
    metric = "mae"

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1)).double()

    def data(self) -> ArrayData:
        g = torch.Generator().manual_seed(3)
        x = torch.randn(self.params.samples, 5, generator=g, dtype=torch.float64)
        return ArrayData(x, x.sum(dim=1, keepdim=True).sin())

    def loss(self, output, target):
        return F.mse_loss(output, target)

    def metrics(self, output, target):
        return {"mae": (output - target).abs().mean()}


def max_rel_diff(a: nn.Module, b: nn.Module) -> float:
    return max(
        ((p - q).abs().max() / q.abs().max().clamp_min(1e-300)).item()
        for p, q in zip(a.parameters(), b.parameters(), strict=True)
    )


TESTS = Path(__file__).resolve().parent  # tests/: helpers.py, exactness_kinds.py, task_files/
TASK_FILES = TESTS / "task_files"
CLI = [sys.executable, "-m", "multilane.engine.cli"]

BROKEN_TASK = (
    "from multilane.engine.tasks.builtin import LinearTask\n"
    "import torch\n"
    "class Broken(LinearTask):\n"
    "    name = 'broken'\n"
    "    def build_model(self):\n"
    "        class M(torch.nn.Linear):\n"
    "            def forward(self, x):\n"
    "                raise ValueError('my model is broken')\n"
    "        return M(10, 1)\n"
)
"""A task file whose model raises in forward: the first step fails with "my model is broken"."""

NO_PARAMS_TASK = (
    "from multilane.engine.tasks.builtin import LinearTask\n"
    "import torch\n"
    "class NoParams(LinearTask):\n"
    "    name = 'np'\n"
    "    def build_model(self):\n"
    "        return torch.nn.Identity()\n"
)
"""A task file whose model has no parameters: refused at set-up ("empty parameter list")."""


def start_long_cli_run(runs_dir: Path, *settings: str, **popen_kwargs) -> subprocess.Popen:
    """``multilane train`` of mlp on cpu:0,cpu:1 for far more steps than any test waits for, in a
    subprocess (for tests that interrupt it); ``settings`` are ``--set KEY=VALUE`` overrides."""
    args = [*CLI, "train", "--task", "mlp", "--steps", "100000", "--devices", "cpu:0,cpu:1"]
    args += ["--runs-dir", str(runs_dir)]
    for setting in settings:
        args += ["--set", setting]
    return subprocess.Popen(args, **popen_kwargs)


def run_folders(runs: Path) -> list[Path]:
    """The run folders in a runs folder, without the hidden write probe a starting run makes there for
    an instant (`check_writable`): a test polling a runs folder must not take the probe for a run."""
    if not runs.is_dir():
        return []
    return sorted(p for p in runs.iterdir() if p.is_dir() and not p.name.startswith("."))


def run_with_a_lone_step(steps: int, lone: int, loss_scale: float):
    """A run (``RunData``, one lane) logged every 0.05 s for ``steps`` steps, stopped after step
    ``lone - 1``, resumed 60 s later, stopped again after step ``lone`` and resumed: step ``lone`` has no
    neighbour on either side of its breaks (the plots and exports draw it as a marker)."""
    from multilane.gui.runs.run_data import RunData

    run = RunData("twice")
    run.add({"kind": "event", "event": "started", "step": 0, "wall_time": 1000.0, "lanes": ["cpu:0"]})
    t = 1000.0
    for s in range(1, steps + 1):
        t += 0.05
        if s in (lone, lone + 1):
            run.add({"kind": "event", "event": "stopped", "step": s - 1, "wall_time": t})
            t += 60.0
            run.add({"kind": "event", "event": "started", "step": s - 1, "wall_time": t, "resumed_from_step": s - 1})
        loss = 1.0 + s / loss_scale
        run.add({"kind": "train", "step": s, "wall_time": t, "loss": loss, "device_loss": {"cpu:0": 1.0}})
    return run


DIVERGE_TASK = str(TASK_FILES / "diverge_at.py")
DIVERGE_AT, DIVERGE_LAST_GOOD = 8, 6
"""The step whose loss (or update) goes non-finite in ``diverge_settings``'s run, and its last checkpoint
before it: checkpoints every 2 steps, logs every 5, so step 8 falls between two log points."""


def diverge_settings(runs: Path, devices: str, strategy: str, at: int, how: str = "loss", steps: int = 12) -> dict:
    """A run of ``task_files/diverge_at.py`` (float64) that goes non-finite at step ``at`` (0: never)."""
    return {
        "task": {"name": DIVERGE_TASK, "params": {"at": at, "how": how}},
        "data": {"batch_size": 8, "val_fraction": 0.0, "workers": 0},
        "optim": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "train": {"steps": steps, "log_every": 5, "checkpoint_every": 2, "eval_every": 0},
        "devices": {"use": devices, "strategy": strategy},
        "telemetry": {"enabled": False},
        "run": {"runs_dir": str(runs), "name": "run"},
    }


def _launch_diverging(tmp_path: Path, strategy: str, how: str) -> tuple[subprocess.CompletedProcess, Path]:
    runs = tmp_path / strategy
    path = tmp_path / f"{strategy}.json"
    path.write_text(json.dumps(diverge_settings(runs, "cpu:0,cpu:1", strategy, DIVERGE_AT, how)))
    r = subprocess.run([*CLI, "train", "--config", str(path)], capture_output=True, text=True, timeout=300)
    (run,) = [p for p in runs.iterdir() if (p / "status.json").is_file()]
    return r, run


def _straight(tmp_path: Path, steps: int) -> dict[str, torch.Tensor]:
    """The single-process engine on 2 lanes, no NaN, ``steps`` steps."""
    from multilane.engine.config import build_config
    from multilane.engine.run.trainer import Trainer
    from multilane.engine.tasks import make_task

    cfg = diverge_settings(tmp_path / f"straight{steps}", "cpu:0,cpu:1", "replicate", 0, steps=steps)
    trainer = Trainer(build_config(cfg), task=make_task(DIVERGE_TASK, cfg["task"]["params"]))
    assert trainer.run().status == "finished"
    return {k: v.detach() for k, v in trainer.model.state_dict().items()}


def _assert_close(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for k, v in want.items():
        assert torch.isfinite(got[k]).all(), f"{what}: {k} is not finite"
        diff = float((got[k].double() - v).abs().max() / v.abs().max().clamp_min(1e-300))
        assert diff <= 1e-10, f"{what}: {k} differs from the straight run's by {diff:.2e}"


def check_diverged_launch(tmp_path: Path, strategy: str, how: str) -> Path:
    """Launch a ddp or fsdp run of ``diverge_settings`` on 2 ranks that goes non-finite at step 8 and
    check what every strategy promises: exit 3, ``diverged``, ``last.pt`` at step 6 equal to the
    single-process engine's straight run (1e-10). The run folder."""
    from multilane.engine.fsdp.sharded import read_model_state

    r, run = _launch_diverging(tmp_path, strategy, how)
    assert r.returncode == 3, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    status = json.loads((run / "status.json").read_text())
    assert (status["state"], status["step"]) == ("diverged", DIVERGE_AT), status
    if how == "weights":
        assert status["message"].startswith(
            f"the weights or the optimizer's state became non-finite at step {DIVERGE_AT}"
        ), status
    else:
        assert status["message"].startswith(f"loss became nan at step {DIVERGE_AT}"), status
    ck = torch.load(run / "checkpoints" / "last.pt", weights_only=True)
    assert ck["step"] == DIVERGE_LAST_GOOD
    _assert_close(read_model_state(run), _straight(tmp_path, DIVERGE_LAST_GOOD), f"{strategy} {how}")
    return run


def resume_clean(tmp_path: Path, run: Path, strategy: str) -> None:
    """``check_diverged_launch``'s run resumed with the bad samples gone: equal to a straight run of every step."""
    from multilane.engine.fsdp.sharded import read_model_state

    r = subprocess.run([*CLI, "train", "--resume", str(run), "--set", "task.params.at=0"], capture_output=True,
                       text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((run / "status.json").read_text())["state"] == "finished"
    _assert_close(read_model_state(run), _straight(tmp_path, 12), f"{strategy} resumed")


def finished_linear_run(runs: Path, steps: int = 2) -> Path:
    """A real finished run of the linear task on one lane (every step logged, no telemetry): its folder."""
    from multilane.engine.config import build_config
    from multilane.engine.run.trainer import Trainer

    cfg = build_config(
        {
            "task": {"name": "linear"},
            "devices": {"use": "cpu:0"},
            "train": {"steps": steps, "log_every": 1},
            "telemetry": {"enabled": False},
            "run": {"runs_dir": str(runs), "name": "r"},
        }
    )
    return Trainer(cfg).run().run_dir
