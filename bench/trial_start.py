"""What a sweep's trials cost to start forked from the sweep's pre-imported server, beside fresh
interpreters.

    python bench/trial_start.py [--trials 4] [--rounds 3] [--steps 5] [--task mlp]

The same ``multilane sweep`` (``--trials`` short trials on one CPU lane, a grid of learning rates), once
with ``MULTILANE_TRIAL_START=exec`` (every trial a fresh interpreter) and once with the default
forkserver (engine/start/), in alternating order, ``--rounds`` times. The table gives the median wall
time of the whole command and the CPU seconds the machine spent meanwhile (/proc/stat, as
bench/rank_start.py: run it on a quiet machine), side by side with their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

from rank_start import measured

CLI = [sys.executable, "-m", "multilane.engine.cli"]


def one_sweep(way: str, trials: int, steps: int, task: str, folder: str) -> tuple[float, float]:
    """(wall seconds, CPU seconds the machine spent) of one sweep."""
    lrs = ",".join(f"{1e-3 * (1 + i):.4g}" for i in range(trials))
    args = [*CLI, "sweep", "--task", task, "--steps", str(steps), "--trials", str(trials), "--devices", "cpu:0"]
    args += ["--sampler", "grid", "--pruner", "none", "--no-table", "--param", f"optim.lr=choice:{lrs}"]
    args += ["--set", "train.eval_every=0", "--set", "train.log_every=1", "--sweeps-dir", folder]
    env = {**os.environ, "MULTILANE_TRIAL_START": way, "MULTILANE_FIT_CHECK": "0"}
    return measured(args, env, way)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--task", default="mlp")
    a = ap.parse_args()
    results: dict[str, list[tuple[float, float]]] = {"exec": [], "forkserver": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):  # alternating order: a load that changes lands on both
            for way in ("exec", "forkserver")[:: 1 if r % 2 == 0 else -1]:
                results[way].append(one_sweep(way, a.trials, a.steps, a.task, os.path.join(tmp, f"{way}{r}")))
    wall = {w: statistics.median(x[0] for x in v) for w, v in results.items()}
    cpu = {w: statistics.median(x[1] for x in v) for w, v in results.items()}
    print(f"sweep of {a.trials} trials on cpu:0, {a.task}, {a.steps} steps each; median of {a.rounds} rounds")
    print("| trials | exec wall s | forkserver wall s | ratio | exec CPU s | forkserver CPU s | ratio |")
    print("|---|---|---|---|---|---|---|")
    print(
        f"| {a.trials} | {wall['exec']:.1f} | {wall['forkserver']:.1f} | {wall['forkserver'] / wall['exec']:.2f} "
        f"| {cpu['exec']:.1f} | {cpu['forkserver']:.1f} | {cpu['forkserver'] / cpu['exec']:.2f} |"
    )


if __name__ == "__main__":
    main()
