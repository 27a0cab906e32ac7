"""Useful trials per hour with 1, 2 and 4 worker processes on one study.

    python bench/sweep_workers.py [--trials 8] [--steps 20] [--step-s 0.1] [--workers 1,2,4]

Each configuration is one study in a fresh SQLite file: `multilane sweep --storage URL --seed 1` plus
N-1 `multilane sweep-worker` processes started at once, one CPU slot each. A *useful* trial is a
COMPLETE trial whose parameters no other trial of the study had: before each worker got its own seed, every worker seeded
its sampler the same way, so with N workers each proposal ran N times and the useful rate stayed flat.

The task is the built-in linear task whose loss also waits ``--step-s`` seconds each step: a stand-in for
GPU-bound steps, during which the CPU is free (on a 2-core machine, CPU-bound trials could only share
the same two cores). Wall time includes every process's start-up, as a user's sweep does.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CLI = [sys.executable, "-m", "multilane.engine.cli"]
TASK = """import time
from multilane.engine.tasks.builtin import LinearTask
class Waiting(LinearTask):
    name = 'waiting'
    def loss(self, output, target):
        time.sleep({step_s})
        return super().loss(output, target)
"""


def one(workers: int, trials: int, steps: int, task: Path, root: Path) -> tuple[float, int, int]:
    import optuna

    url = f"sqlite:///{root / f'w{workers}.db'}"
    name = f"w{workers}"
    common = ["--devices", "cpu:0", "--no-table"]
    sweep = [*CLI, "sweep", "--task", str(task), "--steps", str(steps), "--trials", str(trials), "--storage", url,
             "--name", name, "--pruner", "none", "--seed", "1", "--objective", "loss:min",
             "--param", "optim.lr=log:1e-3:1e-1", "--sweeps-dir", str(root / f"s{workers}"), *common]  # fmt: skip
    t0 = time.perf_counter()
    procs = [subprocess.Popen(sweep, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)]
    for i in range(workers - 1):
        procs.append(
            subprocess.Popen(
                [
                    *CLI,
                    "sweep-worker",
                    "--storage",
                    url,
                    "--study",
                    name,
                    "--sweeps-dir",
                    str(root / f"w{workers}-{i}"),
                    *common,
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    for p in procs:
        _, err = p.communicate()
        if p.returncode != 0:
            sys.exit(f"a process failed: {err[-2000:]}")
    wall = time.perf_counter() - t0
    study = optuna.load_study(study_name=name, storage=url)
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    useful = len({tuple(sorted(t.params.items())) for t in complete})
    return wall, len(complete), useful


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--step-s", type=float, default=0.1)
    ap.add_argument("--workers", default="1,2,4")
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="multilane-bench-workers-"))
    task = root / "waiting_task.py"
    task.write_text(TASK.format(step_s=a.step_s))
    rows = []
    for n in (int(x) for x in a.workers.split(",")):
        wall, complete, useful = one(n, a.trials, a.steps, task, root)
        rows.append((n, wall, complete, useful, useful / wall * 3600))
    base = rows[0][4]
    print(f"{a.trials} trials of {a.steps} steps x {a.step_s} s; one study per row (SQLite), --seed 1")
    print("| workers | wall (s) | complete | useful (distinct params) | useful trials / hour | x 1 worker |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for n, wall, complete, useful, rate in rows:
        print(f"| {n} | {wall:.1f} | {complete} | {useful} | {rate:.0f} | {rate / base:.2f} |")


if __name__ == "__main__":
    main()
