"""What the default wall-time checkpoint cadence costs: the time to save one checkpoint, as a share
of the interval between two, for models from small to large.

    python bench/checkpoint_cost.py [--repeats 3] [--folder DIR] [--max-params 25e6]

A checkpoint holds the model's parameters and the optimizer's state (Adam: two more tensors of the
same size), written by ``RunDir.save_checkpoint`` exactly as a run writes it: to a temporary file,
fsynced, renamed over the last one. The training loop stops while it saves, so the cost of a
cadence of M minutes is save_s / (60 M). Run it on the disk your runs go to (``--folder``).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from multilane.engine.config import CHECKPOINT_MINUTES
from multilane.engine.rundir.runlog import RunDir

SIZES = [150e3, 1e6, 5e6, 25e6, 100e6]  # parameters (mlp width 256 has ~150k)


def state(params: int) -> dict:
    w = torch.randn(params)
    return {
        "model": {"w": w},
        "optimizer": {"state": {0: {"step": torch.tensor(1.0), "exp_avg": w.clone(), "exp_avg_sq": w.clone()}}},
        "step": 1,
        "config": {},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--folder", default=None, help="where to write (default: a temporary folder)")
    ap.add_argument("--max-params", type=float, default=25e6)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.folder) as tmp:
        rd = RunDir.create(tmp, "bench")
        cadences = sorted({1.0, 2.0, CHECKPOINT_MINUTES})
        head = " ".join(f"{f'every {m:g} min':>13}" for m in cadences)
        print(f"{'parameters':>12} {'file MB':>8} {'save s (median)':>16} {head}")
        for n in [s for s in SIZES if s <= args.max_params]:
            st = state(int(n))
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                rd.save_checkpoint(st)
                times.append(time.perf_counter() - t0)
            mb = (Path(rd.path) / "checkpoints/last.pt").stat().st_size / 1e6
            med = statistics.median(times)
            shares = " ".join(f"{100 * med / (60 * m):12.2f}%" for m in cadences)
            print(f"{n:12,.0f} {mb:8.1f} {med:16.3f} {shares}")
            del st
        rd.close()
    print(f"\ndefault train.checkpoint_minutes = {CHECKPOINT_MINUTES:g}")


if __name__ == "__main__":
    main()
