"""The input pipeline: an input-heavy task with 0, 1, 2 DataLoader workers, and the LM task on 1 and 2 lanes.

    python bench/input_pipeline.py [--rounds 3] [--steps 30]

Table 1 trains a small CNN on PNG files read by torchvision's ImageFolder (decode, random crop and
flip, normalize: the imagefolder task with a light model, so that reading dominates) on one CPU lane,
with 0, 1 and 2 worker processes. "data" is the share of the step time spent waiting for the next batch
(``phase_ms["data"] / step_ms``). Table 2 trains the charlm task (its defaults: 2 blocks, width 128,
context 128) on 1 and 2 CPU lanes. Settings take turns round by round; medians over the rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from multilane.engine.config import build_config
from multilane.engine.run.trainer import Trainer
from multilane.engine.tasks.imagefolder import ImageFolderTask, torchvision_or_hint
from torch import nn


class PngTask(ImageFolderTask):
    """imagefolder's data (ImageFolder, PIL decode, transforms) with a light CNN: an input-bound task."""

    name = "png-bench"

    def build_model(self) -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(4),
            nn.Flatten(),
            nn.Linear(16 * (self.params.image_size // 4) ** 2, self.num_classes()),
        )


def make_pngs(root: Path, classes: int = 4, per_class: int = 120, size: int = 96) -> Path:
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    for c in range(classes):
        (root / "train" / f"c{c}").mkdir(parents=True)
        (root / "val" / f"c{c}").mkdir(parents=True)
        for i in range(per_class):
            img = (torch.rand(size, size, 3, generator=g) * 255).to(torch.uint8)
            part = "val" if i % 10 == 0 else "train"
            Image.fromarray(img.numpy()).save(root / part / f"c{c}" / f"{i}.png")
    return root


def measure(cfg: dict, task=None, skip_logs: int = 1) -> dict[str, float]:
    """samples/s, step ms and the data share, from the train records after the first (worker start-up)."""
    records: list[dict] = []

    class Keep:
        def __getattr__(self, name):
            return lambda *a, **k: None

        def on_log(self, r):
            records.append(r)

    trainer = Trainer(build_config(cfg), callbacks=[Keep()], task=task)
    result = trainer.run()
    assert result.status == "finished", result.message
    recs = records[skip_logs:] or records
    step_ms = statistics.mean(r["step_ms"] for r in recs)
    data_ms = statistics.mean(r["phase_ms"]["data"] for r in recs)
    sps = statistics.mean(r["samples_per_s"] for r in recs)
    return {"sps": sps, "step_ms": step_ms, "data": data_ms / step_ms}


def base(runs: str, steps: int, devices: str) -> dict:
    return {
        "run": {"runs_dir": runs, "name": "bench"},
        "devices": {"use": devices},
        "train": {"steps": steps, "log_every": max(1, steps // 3), "eval_every": 0},
        "telemetry": {"enabled": False},
    }


def main() -> None:
    torch.set_flush_denormal(True)
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads of the training process (default 1)")
    args = ap.parse_args()
    # On a shared 2-core machine two OpenMP threads spinning against worker processes (and anything
    # else running) made one-lane steps 5x slower and erratic; CPU lanes use one thread each anyway.
    torch.set_num_threads(args.threads)
    torchvision_or_hint()
    with tempfile.TemporaryDirectory() as tmp:
        root = make_pngs(Path(tmp) / "png")
        runs = str(Path(tmp) / "runs")
        print(
            f"torch {torch.__version__}, {os.cpu_count()} cores, {torch.get_num_threads()} intra-op threads; "
            f"{args.rounds} rounds of {args.steps} steps each, settings in turn; medians; "
            f"load average {os.getloadavg()[0]:.1f}\n"
        )
        print("Table 1: PNG folder (96x96 PNGs, random crop to 32 + flip + normalize), small CNN, batch 64, cpu:0")
        results: dict[int, list[dict]] = {0: [], 1: [], 2: []}
        params = {"root": str(root), "image_size": 32, "augment": True}
        for _ in range(args.rounds):
            for w in results:
                cfg = base(runs, args.steps, "cpu:0")
                cfg["data"] = {"batch_size": 64, "workers": w}
                cfg["task"] = {"name": "imagefolder", "params": params}
                results[w].append(measure(cfg, task=PngTask(PngTask.Params(**params))))
        print(f"{'workers':>8} {'samples/s':>10} {'step ms':>8} {'waiting on data':>16}")
        for w, rs in results.items():
            print(
                f"{w:>8} {statistics.median(r['sps'] for r in rs):>10,.0f} "
                f"{statistics.median(r['step_ms'] for r in rs):>8.1f} "
                f"{statistics.median(r['data'] for r in rs):>15.0%}"
            )
        print("\nTable 2: charlm (2 blocks, width 128, context 128, dropout 0.1), batch 32, workers 0 and 1")
        lm: dict[tuple[str, int], list[dict]] = {(d, w): [] for d in ("cpu:0", "cpu:0,cpu:1") for w in (0, 1)}
        for _ in range(args.rounds):
            for d, w in lm:
                cfg = base(runs, args.steps, d)
                cfg["data"] = {"batch_size": 32, "workers": w}
                cfg["task"] = {"name": "charlm", "params": {"sample_bytes": 0}}
                lm[(d, w)].append(measure(cfg))
        print(f"{'devices':>12} {'workers':>8} {'samples/s':>10} {'step ms':>8} {'waiting on data':>16}")
        for (d, w), rs in lm.items():
            print(
                f"{d:>12} {w:>8} {statistics.median(r['sps'] for r in rs):>10,.0f} "
                f"{statistics.median(r['step_ms'] for r in rs):>8.1f} "
                f"{statistics.median(r['data'] for r in rs):>15.0%}"
            )


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"\n({time.time() - t0:.0f} s)", file=sys.stderr)
