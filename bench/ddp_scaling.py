"""Samples/s of one lane, two CPU lanes (threads, one process) and two ddp processes (Gloo), side by side.

    python bench/ddp_scaling.py [--steps 400] [--repeats 2] [--batch-size 64]

Each run is a real ``multilane train`` (a subprocess; ddp through torch's elastic launcher) on the
same task, config and data; throughput is the median ``samples_per_s`` of its train records after
the first (warm-up) window. The runs of each task are interleaved ``--repeats`` times, so a busy
machine slows each mode alike; the table shows the best repeat and the ratios to one lane. Every run
gets OMP_NUM_THREADS=1 (``--threads``): one core's worth of compute per lane or rank, so that the
modes differ only in how lanes run (threads in one process, or processes), not in intra-op threads.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from multilane.engine.rundir.runlog import read_metrics

MODES = {
    "1 lane": ["--devices", "cpu:0"],
    "2 lanes (threads)": ["--devices", "cpu:0,cpu:1"],
    "2 ddp processes": ["--devices", "cpu:0,cpu:1", "--strategy", "ddp"],
}


def throughput(task: str, mode: list[str], steps: int, batch: int, threads: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        args = [sys.executable, "-m", "multilane.engine.cli", "train", "--task", task, "--steps", str(steps)]
        args += ["--batch-size", str(batch), "--runs-dir", tmp, *mode]
        for s in ("train.log_every=20", "train.eval_every=0", "telemetry.enabled=false"):
            args += ["--set", s]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        r = subprocess.run(args, capture_output=True, text=True, timeout=900, env=env)
        if r.returncode != 0:
            print(f"  {task} {' '.join(mode)}: exit {r.returncode}: {r.stderr.strip()[-2000:]}", file=sys.stderr)
            return 0.0
        (run,) = list(Path(tmp).iterdir())
        rates = [r["samples_per_s"] for r in read_metrics(run) if r["kind"] == "train"][1:]
        return statistics.median(rates)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every run")
    a = p.parse_args()
    print(
        f"steps {a.steps}, batch {a.batch_size}, OMP_NUM_THREADS={a.threads}, best of {a.repeats} "
        f"(samples/s; ratio to 1 lane); load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    print(f"{'task':8} " + " ".join(f"{m:>26}" for m in MODES))
    for task in ("digits", "mlp"):
        best = dict.fromkeys(MODES, 0.0)
        for _ in range(a.repeats):
            for name, mode in MODES.items():
                best[name] = max(best[name], throughput(task, mode, a.steps, a.batch_size, a.threads))
        base = best["1 lane"]
        cells = [f"{v:>16,.0f} ({v / base:4.2f}x)" for v in best.values()]
        print(f"{task:8} " + " ".join(f"{c:>26}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
