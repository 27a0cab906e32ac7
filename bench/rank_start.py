"""What a ddp run's start costs with its ranks forked from a pre-imported server, beside fresh interpreters.

    python bench/rank_start.py [--ranks 2 3] [--rounds 3] [--steps 5] [--task mlp]

For each rank count, the same short ``multilane train --strategy ddp`` run on CPU lanes, once with
``MULTILANE_RANK_START=exec`` (every rank a fresh interpreter: torchrun's default) and once with the
default forkserver (engine/start/ranks.py), in alternating order, ``--rounds`` times. The
table gives the median wall time of the whole command and the CPU seconds the machine spent meanwhile
(/proc/stat: run it on a quiet machine; a 2-core machine's CPU is what several runs at once compete
for), side by side with their ratio. The run's own training is a few steps: what is left is start-up.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

CLI = [sys.executable, "-m", "multilane.engine.cli"]


def busy_seconds() -> float:
    """CPU seconds this machine has spent busy so far (/proc/stat): a forked rank's time is counted
    too, which the launcher's ``RUSAGE_CHILDREN`` would miss (the server, not the launcher, reaps it).
    Run the bench on a quiet machine: what else runs is counted as well."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def measured(args: list[str], env: dict[str, str], what: str) -> tuple[float, float]:
    """(wall seconds, CPU seconds the machine spent) of one command; a failure ends the bench."""
    before = busy_seconds()
    t0 = time.perf_counter()
    r = subprocess.run(args, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    cpu = busy_seconds() - before
    if r.returncode != 0:
        sys.exit(f"failed ({what}): {r.stderr[-2000:]}")
    return wall, cpu


def one_run(ranks: int, way: str, steps: int, task: str, runs: str) -> tuple[float, float]:
    """(wall seconds, CPU seconds the machine spent) of one ddp run."""
    devices = ",".join(f"cpu:{i}" for i in range(ranks))
    args = [*CLI, "train", "--strategy", "ddp", "--devices", devices, "--task", task, "--steps", str(steps)]
    args += ["--runs-dir", runs, "--set", "train.eval_every=0", "--set", "train.log_every=1"]
    env = {**os.environ, "MULTILANE_RANK_START": way, "MULTILANE_FIT_CHECK": "0"}
    return measured(args, env, f"{way}, {ranks} ranks")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--task", default="mlp")
    a = ap.parse_args()
    print(f"ddp on CPU lanes, {a.task}, {a.steps} steps; median of {a.rounds} rounds in alternating order")
    print("| ranks | exec wall s | forkserver wall s | ratio | exec CPU s | forkserver CPU s | ratio |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for n in a.ranks:
            got: dict[str, list[tuple[float, float]]] = {"exec": [], "forkserver": []}
            for i in range(a.rounds):
                for way in ("exec", "forkserver") if i % 2 == 0 else ("forkserver", "exec"):
                    got[way].append(one_run(n, way, a.steps, a.task, tmp))
            w = {k: statistics.median(x[0] for x in v) for k, v in got.items()}
            c = {k: statistics.median(x[1] for x in v) for k, v in got.items()}
            print(
                f"| {n} | {w['exec']:.1f} | {w['forkserver']:.1f} | {w['forkserver'] / w['exec']:.2f} "
                f"| {c['exec']:.1f} | {c['forkserver']:.1f} | {c['forkserver'] / c['exec']:.2f} |"
            )


if __name__ == "__main__":
    main()
