"""Will it fit: the memory forecast against the measured peak of real runs, side by side in one run.

    python bench/memory_forecast.py                              # two CPU lanes (the RAM they share)
    python bench/memory_forecast.py --devices cuda:0,cuda:1      # on a GPU machine: each GPU's own line
    python bench/memory_forecast.py --strategies fsdp            # fsdp on 2 processes: each rank's peak
    python bench/memory_forecast.py --strategies ddp             # ddp, the same way

For three models (the MLP, the digits CNN, the charlm Transformer: built-in tasks) at two batch sizes
each, and every strategy given (default: replicate and persistent), it trains a few steps with the fit
check on and prints, per memory: the forecast made by the probe before the run (engine/plan/probe.py),
the peak the run itself measured (CUDA: max_memory_allocated; CPU lanes: live tensor storage, during
its 2nd and 3rd steps), the error, the batches the probe took and the probe's wall time. Goal: every
error within 10 %. fsdp and ddp run through the CLI (one process per device): its launcher forecasts, each
rank measures its own peak, and the rows are the run folder's ``memory`` event, one per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ["MULTILANE_FIT_CHECK"] = "1"

from multilane.engine.config import build_config
from multilane.engine.plan.forecast import gib
from multilane.engine.run.trainer import Trainer

CLI = [sys.executable, "-m", "multilane.engine.cli"]

CASES = [("mlp", 256), ("mlp", 4096), ("digits", 64), ("digits", 512), ("charlm", 16), ("charlm", 96)]


def one(task: str, batch: int, devices: str, strategy: str, runs: str) -> list[list[str]]:
    config = build_config(
        {
            "task": {"name": task},
            "devices": {"use": devices, "strategy": strategy},
            "data": {"batch_size": batch, "workers": 0},
            "train": {"steps": 3, "log_every": 1, "eval_every": 0, "checkpoint_minutes": 0},
            "telemetry": {"enabled": False},
            "run": {"runs_dir": runs, "name": f"{task}-{batch}"},
        }
    )
    t0 = time.perf_counter()
    trainer = Trainer(config)
    result = trainer.run()
    wall = time.perf_counter() - t0
    if result.status != "finished" or not result.memory:
        return [[task, str(batch), strategy, "-", "-", "-", "-", f"{result.status}: {result.message}", ""]]
    rows = []
    for name, r in result.memory.items():
        line = next(x for x in trainer.forecast.lines if x["name"] == name)
        probed = ",".join(str(s) for s, _ in line["phases"]["forward"])
        err = (r["forecast"] - r["measured"]) / r["measured"] * 100
        rows.append(
            [task, f"{batch:,}", strategy, name, gib(r["forecast"]), gib(r["measured"]), f"{err:+.1f} %", probed,
             f"{wall:.1f} s"]
        )  # fmt: skip
    return rows


def one_ranks(task: str, batch: int, devices: str, strategy: str, runs: str, sets: list[str]) -> list[list[str]]:
    """An fsdp or ddp run: ``multilane train`` (its launcher forecasts, each rank measures its own peak),
    the rows from the run folder's ``memory`` event (one per rank) and the probe's batches from ``plan``."""
    args = ["--task", task, "--devices", devices, "--strategy", strategy, "--batch-size", str(batch)]
    args += [x for kv in sets for x in ("--set", kv)]
    label = strategy + "".join(f" {kv.split('.')[-1]}" for kv in sets)
    plan = subprocess.run([*CLI, "plan", *args, "--json"], capture_output=True, text=True, timeout=900)
    lines = json.loads(plan.stdout.splitlines()[-1])["lines"] if plan.returncode == 0 else []
    probed = ",".join(str(s) for s, _ in lines[0]["phases"]["forward"]) if lines else "-"
    before = set(os.listdir(runs))
    t0 = time.perf_counter()
    sets = ["train.log_every=1", "train.eval_every=0", "train.checkpoint_minutes=0", "data.workers=0"]
    cmd = [*CLI, "train", *args, "--steps", "3", "--runs-dir", runs, *[x for kv in sets for x in ("--set", kv)]]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - t0
    new = [d for d in os.listdir(runs) if d not in before]
    events = []
    for d in new:
        with open(os.path.join(runs, d, "metrics.jsonl")) as f:
            events += [json.loads(x) for x in f if '"memory"' in x]
    peaks = next((e["peaks"] for e in events if e.get("event") == "memory"), None)
    if r.returncode != 0 or not peaks:
        return [[task, f"{batch:,}", label, "-", "-", "-", "-", f"exit {r.returncode}: {r.stderr[-200:]}", ""]]
    rows = []
    for name, p in peaks.items():
        err = (p["forecast"] - p["measured"]) / p["measured"] * 100
        rows.append(
            [task, f"{batch:,}", label, name, gib(p["forecast"]), gib(p["measured"]), f"{err:+.1f} %", probed,
             f"{wall:.1f} s"]
        )  # fmt: skip
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", default="cpu:0,cpu:1")
    ap.add_argument("--strategies", default="replicate,persistent")
    ap.add_argument("--tasks", default="mlp,digits,charlm", help="which of the three models")
    ap.add_argument("--set", action="append", default=[], help="fsdp, ddp: a setting for every run (KEY=VALUE)")
    args = ap.parse_args()
    head = ["task", "batch", "strategy", "memory", "forecast", "measured", "error", "probe samples", "run wall"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="memory-forecast-") as runs:
        for task, batch in [c for c in CASES if c[0] in args.tasks.split(",")]:
            for strategy in args.strategies.split(","):
                if strategy in ("fsdp", "ddp"):
                    rows += one_ranks(task, batch, args.devices, strategy, runs, args.set)
                else:
                    rows += one(task, batch, args.devices, strategy, runs)
                print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(r) + " |")
    errors = [abs(float(r[6].split()[0])) for r in rows if r[6] != "-"]
    print(f"\nlargest error {max(errors):.1f} % over {len(errors)} runs (goal: within 10 %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
