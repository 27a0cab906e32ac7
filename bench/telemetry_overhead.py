"""Training throughput with the telemetry sampler on and off, side by side in one run.

    python bench/telemetry_overhead.py [--rounds 20] [--steps 40]

The same trainer runs blocks of ``--steps`` steps with the sampler off, on, and off again, in a
shuffled order every round, so machine noise lands on all alike; the second "off" gives the noise
floor. The sampler runs at its default 5 Hz (and
at 20 Hz, to show the margin). Target: throughput on / off >= 0.98.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from multilane.engine.config import build_config
from multilane.engine.run.trainer import Trainer
from multilane.engine.telemetry.sampler import TelemetrySampler


def trainer(devices: str) -> Trainer:
    cfg = build_config(
        {
            "task": {"name": "mlp", "params": {"width": 512, "depth": 3}},
            "data": {"batch_size": 256},
            "devices": {"use": devices},
            "train": {"steps": 10**9, "log_every": 10},
        }
    )
    t = Trainer(cfg)
    t._setup()
    t.callbacks = []
    t._window_reset(len(t.devices))
    return t


def block(t: Trainer, steps: int) -> float:
    """Samples per second over ``steps`` steps."""
    t0 = time.perf_counter()
    samples = 0
    for _ in range(steps):
        t.spread.train_step(t, 1)
        t.step += 1
        samples += t.config.data.batch_size
        if t.step % 10 == 0:
            t._log()
    return samples / (time.perf_counter() - t0)


def main() -> None:
    torch.set_flush_denormal(True)
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    print(
        f"torch {torch.__version__}; mlp 512x3, batch 256; {args.rounds} rounds of one block of {args.steps} steps "
        "for each of off / on / off again, in a shuffled order; medians"
    )
    print("'A/A' compares the two 'off' blocks: the noise floor of this machine.\n")
    print(f"{'devices':14} {'sampler':>8} {'off samples/s':>14} {'on samples/s':>13} {'on/off':>7} {'A/A':>6}")
    rng = random.Random(0)
    for devices in ("cpu:0", "cpu:0,cpu:1"):
        for rate in (5.0, 20.0):
            t = trainer(devices)
            records: list[dict] = []
            block(t, 20)  # warm-up
            runs: dict[str, list[float]] = {"off": [], "on": [], "again": []}
            for _ in range(args.rounds):
                order = list(runs)
                rng.shuffle(order)
                for kind in order:
                    if kind != "on":
                        runs[kind].append(block(t, args.steps))
                        continue
                    s = TelemetrySampler(
                        t.devices,
                        t.backend.lane_names,
                        records.append,
                        rate_hz=rate,
                        busy_seconds=t.backend.lane_busy_seconds,
                    )
                    s.start()
                    runs[kind].append(block(t, args.steps))
                    s.stop()
            m = {k: statistics.median(v) for k, v in runs.items()}
            print(
                f"{devices:14} {rate:6.0f}Hz {m['off']:14,.0f} {m['on']:13,.0f} {m['on'] / m['off']:7.3f} "
                f"{m['again'] / m['off']:6.3f}"
            )
            t.backend.close()


if __name__ == "__main__":
    main()
