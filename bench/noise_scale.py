"""The noise scale a default run shows, against brute force, under each strategy.

    python bench/noise_scale.py [--steps 500] [--strategies replicate,persistent]

A float64 MLP (12 → 32 → 1, tanh) on 4,096 regression samples; the learning rate is 1e-12, so the
weights, hence the mean gradient ``G`` and the per-sample covariance ``Σ``, stay put. Brute force: every
training sample's own gradient (``torch.func``: ``vmap`` of ``grad``) at the run's final weights gives
``|G|²``, ``tr Σ`` and ``B_simple = tr Σ / |G|²``. The run is a DEFAULT one — ``health`` as shipped
(the noise scale measured every ``health.noise_every`` = 1 step, averaged over a window of
``noise_decay`` = 0.99, read every 10 steps) — on 2 to 4 lanes, even or uneven shares (``devices.weights``),
batch 64, plus one epoch-sized case whose last batch is short; ``--seeds`` runs per case, each with its
own data order and weights (its own truth). Goal: the displayed value within ±30 % of brute force in
every run, and its 95 % band holding the truth in about 95 % of them (a 95 % band misses one run in 20
by design).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from multilane.engine.config import build_config
from multilane.engine.run.trainer import Trainer, TrainerCallback
from multilane.engine.tasks import ArrayData, Task
from torch import nn

# the tests' brute force (every sample's own gradient, torch.func): one copy of it
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "engine" / "health"))
from test_noise_scale import brute_force

F64 = torch.float64
N, D, H = 4000, 12, 32


class MlpRegression(Task):
    name = "mlp-regression"

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(D, H, dtype=F64), nn.Tanh(), nn.Linear(H, 1, dtype=F64))

    def data(self):
        g = torch.Generator().manual_seed(3)
        x = torch.randn(N, D, generator=g, dtype=F64)
        y = torch.sin(x[:, :3].sum(1, keepdim=True)) + 1.5 * torch.randn(N, 1, generator=g, dtype=F64) + 1
        return ArrayData(x, y), None

    def loss(self, output, target):
        return nn.functional.mse_loss(output, target)


class Last(TrainerCallback):
    noise: dict | None = None

    def on_log(self, record: dict) -> None:
        self.noise = record.get("noise") or self.noise


def run(strategy: str, lanes: int, weights: list[int], steps: int | None, epochs: int, runs_dir: str, seed: int):
    """A default run of the MLP; ``(the last noise record, brute force |G|², tr Σ, the trainer)``."""
    train = {"steps": steps, "seed": seed} if steps else {"epochs": epochs, "seed": seed}
    cfg = build_config(
        {
            "devices": {"use": ",".join(f"cpu:{i}" for i in range(lanes)), "strategy": strategy, "weights": weights},
            "data": {"batch_size": 64, "val_fraction": 0.0},
            "optim": {"name": "sgd", "lr": 1e-12},
            "train": {**train, "eval_every": 0},
            "telemetry": {"enabled": False},
            "run": {"runs_dir": runs_dir},
        }
    )
    last, task = Last(), MlpRegression()
    t = Trainer(cfg, callbacks=[last], task=task)
    t.run()
    data = task.data()[0]
    return last.noise, *brute_force(t.model, data.inputs, data.target), t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--strategies", default="replicate,persistent")
    ap.add_argument("--runs-dir", default="/tmp/multilane-bench-noise")
    ap.add_argument("--seeds", type=int, default=3, help="runs per case, each its own data order and weights")
    args = ap.parse_args()
    print(
        f"torch {torch.__version__}; float64 MLP {D}-{H}-1 on {N} samples, batch 64, lr 1e-12, the health section's "
        f"defaults\n"
    )
    head = f"{'strategy':11} {'lanes':16} {'steps':>6} {'measured':>8} {'shown':>7} {'95 % band':>15} {'brute':>7}"
    print(head + f" {'shown/bf':>8} {'in band':>7}")
    cases = [(2, [], args.steps, 0), (3, [3, 1, 2], args.steps, 0), (4, [1, 1, 2, 4], args.steps, 0)]
    cases.append((2, [2, 1], None, 8))  # 8 epochs of 63 batches, each epoch's last one 32 samples
    bad = within = held = total = 0
    for strategy in args.strategies.split(","):
        for (lanes, weights, steps, epochs), seed in [(c, s) for c in cases for s in range(args.seeds)]:
            t0 = time.perf_counter()
            noise, g2, trace, t = run(strategy, lanes, weights, steps, epochs, args.runs_dir, seed)
            truth = trace / g2
            n = noise or {}
            b, lo, hi = n.get("b_simple"), n.get("lo"), n.get("hi")
            near = b is not None and abs(b / truth - 1) <= 0.3
            holds = lo is not None and hi is not None and lo <= truth <= hi
            ok = near and holds
            bad += not near
            within, held, total = within + near, held + holds, total + 1
            shares = f"{lanes} " + (str(weights) if weights else "even") + f" s{seed}"
            band = f"{lo:,.1f}–{hi:,.1f}" if lo is not None and hi is not None else "unbounded"
            print(
                f"{strategy:11} {shares:16} {t.step:6d} {n.get('steps', 0):8d} {b or float('nan'):7.1f} {band:>15} "
                f"{truth:7.1f} {(b or float('nan')) / truth:8.3f} {'yes' if ok else 'NO':>7}   "
                f"({time.perf_counter() - t0:.1f} s)"
            )
    print(f"\nwithin ±30 %: {within}/{total}; the 95 % band holds the truth: {held}/{total} (expected ~95 %)")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
