"""The gradient noise scale from the lanes against brute force, side by side in one run.

    python bench/noise_scale.py [--steps 400]

Linear regression (float64, 4,096 samples, 8 features, batch 64), whose per-sample gradients are
known in closed form: the brute-force ``|G|²``, ``tr Σ`` and ``B_simple = tr Σ / |G|²`` come from every
sample's gradient at the run's weights (the learning rate is 1e-12: the weights, hence ``G`` and
``Σ``, stay put). The run samples health at every step and smooths with ``health.noise_decay =
0.995``. Goal: the estimate within 10 % of brute force.
"""

from __future__ import annotations

import argparse
import time

import torch
from multilane.engine.config import build_config
from multilane.engine.run.trainer import Trainer, TrainerCallback
from multilane.engine.tasks import ArrayData, Task
from torch import nn

F64 = torch.float64
N, D = 4096, 8


class LinearRegression(Task):
    name = "linreg"

    def __init__(self, near: float | None = None) -> None:
        super().__init__()
        self.near = near  # start this far from the least-squares weights (None: torch's init)

    def build_model(self) -> nn.Module:
        model = nn.Linear(D, 1, dtype=F64)
        if self.near is not None:
            data = self.data()[0]
            x = torch.cat([data.inputs, torch.ones(N, 1, dtype=F64)], 1)
            best = torch.linalg.lstsq(x, data.target).solution.reshape(-1)
            with torch.no_grad():
                model.weight.copy_(best[:D] + self.near)
                model.bias.copy_(best[D:] + self.near)
        return model

    def data(self):
        g = torch.Generator().manual_seed(3)
        x = torch.randn(N, D, generator=g, dtype=F64) * torch.linspace(0.5, 2, D, dtype=F64)
        y = x @ torch.linspace(-1, 1, D, dtype=F64)[:, None] + 0.5 * torch.randn(N, 1, generator=g, dtype=F64) + 3
        return ArrayData(x, y), None

    def loss(self, output, target):
        return nn.functional.mse_loss(output, target)


def brute_force(model: nn.Linear, data: ArrayData) -> tuple[float, float]:
    r = 2 * (model(data.inputs) - data.target).detach()
    per_sample = torch.cat([r * data.inputs, r], dim=1)
    G = per_sample.mean(0)
    return G.square().sum().item(), (per_sample - G).square().sum(1).mean().item()


class Last(TrainerCallback):
    noise: dict | None = None

    def on_log(self, record: dict) -> None:
        self.noise = record.get("noise")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=400)
    args = ap.parse_args()
    print(f"torch {torch.__version__}; linear regression, N={N}, D={D}, batch 64, {args.steps} steps, every step\n")
    print(
        f"{'strategy':11} {'lanes':15} {'|G|² est/bf':>12} {'trΣ est/bf':>11} {'B_simple':>9} {'brute':>7} {'ratio':>6}"
    )
    cases = [
        ("replicate", "cpu:0,cpu:1", [], None),
        ("persistent", "cpu:0,cpu:1", [], None),
        ("replicate", "cpu:0,cpu:1,cpu:2,cpu:3", [], None),
        ("persistent", "cpu:0,cpu:1,cpu:2", [3, 1, 2], None),
        ("replicate", "cpu:0,cpu:1", [], 0.05),
        ("persistent", "cpu:0,cpu:1,cpu:2", [3, 1, 2], 0.05),
    ]
    for strategy, devices, weights, near in cases:
        cfg = build_config(
            {
                "devices": {"use": devices, "strategy": strategy, "weights": weights},
                "data": {"batch_size": 64},
                "optim": {"name": "sgd", "lr": 1e-12},
                "train": {"steps": args.steps, "log_every": args.steps, "eval_every": 0},
                "health": {"every": 1, "noise_decay": 0.995},
                "telemetry": {"enabled": False},
                "run": {"runs_dir": "/tmp/multilane-bench-noise"},
            }
        )
        last = Last()
        task = LinearRegression(near)
        t0 = time.perf_counter()
        t = Trainer(cfg, callbacks=[last], task=task)
        t.run()
        g2, trace = brute_force(t.model, task.data()[0])
        n = last.noise or {}
        lanes = f"{devices.count(',') + 1}" + (f" {weights}" if weights else " even") + (" near" if near else "")
        print(
            f"{strategy:11} {lanes:15} {n['g2'] / g2:12.3f} {n['trace'] / trace:11.3f} {n['b_simple']:9.1f} "
            f"{trace / g2:7.1f} {n['b_simple'] / (trace / g2):6.3f}   ({time.perf_counter() - t0:.1f} s)"
        )


if __name__ == "__main__":
    main()
