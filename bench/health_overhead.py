"""What health costs: step time with health at its default cadence, off, and at every step, side by side.

    python bench/health_overhead.py [--rounds 6] [--steps 100] [--tasks digits,charlm]

One trainer per task on two CPU lanes (replicate; charlm small enough for a bench: context 64, width
64, batch 16); blocks of ``--steps`` steps run the trainer's own
step, log every 10 steps and keep the replay state at each log window's start, as ``Trainer._loop``
does. Each round runs every variant once, in a shuffled order, so machine noise lands on all alike;
a second "off" block gives the noise floor (A/A). Variants:

- off: ``health.enabled = false`` (no sampling, no replay state);
- default: ``health.every`` at its default, the replay state kept at every log window (the run's default);
- keep only: the replay state kept, no sampling (the cost of "where a NaN began" on finite steps);
- every=1, and every=1 without activations / without the noise probe: the cost per quantity.

Goal: default / off within 2 % of step time.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from multilane.engine.config import build_config
from multilane.engine.health.run_health import RunHealth, make_monitor
from multilane.engine.run.energy import EnergyMeter
from multilane.engine.run.trainer import Trainer

TASKS = {
    "digits": ({"name": "digits"}, 64),
    "charlm": ({"name": "charlm", "params": {"context": 64, "width": 64, "sample_bytes": 0}}, 16),
}


def trainer(task: str) -> Trainer:
    spec, batch = TASKS[task]
    cfg = build_config(
        {
            "task": spec,
            "data": {"batch_size": batch, "workers": 0},
            "devices": {"use": "cpu:0,cpu:1"},
            "train": {"steps": 10**9, "log_every": 10},
        }
    )
    t = Trainer(cfg)
    t._setup()
    t.callbacks = []
    t.energy = EnergyMeter(None)
    t.window.resume()
    return t


def set_variant(t: Trainer, variant: str) -> None:
    h = t.config.health.model_copy()
    keep = True
    if variant.startswith("off"):
        h.enabled, keep = False, False
    elif variant == "keep only":
        h.enabled = False
    elif variant.startswith("every=1"):
        h.every = 1
        if "activations" in variant:
            h.activations = ""
    t.config = t.config.model_copy(update={"health": h})
    t.health = make_monitor(t, len(t.devices), t.backend.output_device)
    if "noise" in variant:
        t.health.probe = None
    t.strategy.lane_grads = t.health.probe
    t.run_health = RunHealth(replay=keep)


def block(t: Trainer, steps: int) -> float:
    """CPU milliseconds (this process, every thread) per step over ``steps`` steps (sampling, logging
    and keeping included): on a machine shared with other work, CPU time is what the variants change;
    wall time also counts the others' load."""
    t0 = time.process_time()
    for _ in range(steps):
        if t.window.steps == 0:
            t.run_health.window_start(t)
        t._train_step(1)
        t.step += 1
        if t.step % 10 == 0:
            t._log()
    return 1000 * (time.process_time() - t0) / steps


VARIANTS = ["off", "default", "off again", "keep only", "every=1", "every=1 no activations", "every=1 no noise"]


def main() -> None:
    torch.set_flush_denormal(True)
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--tasks", default="digits,charlm")
    args = ap.parse_args()
    every = build_config({}).health.every
    print(
        f"torch {torch.__version__}; two CPU lanes (digits: batch 64; charlm context 64, width 64, batch 16), log every 10 steps, health.every={every} (default); "
        f"{args.rounds} rounds of one {args.steps}-step block per variant, shuffled; medians of CPU ms/step\n"
    )
    rng = random.Random(0)
    head = f"{'task':8} {'off ms':>7} {'default':>8} {'def/off':>8} {'A/A':>6} {'keep/off':>9} {'every=1/off':>12}"
    print(head + f" {'activations':>12} {'noise':>7} {'layers':>7}")
    for task in args.tasks.split(","):
        t = trainer(task)
        set_variant(t, "default")
        block(t, 20)  # warm-up
        runs: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for _ in range(args.rounds):
            order = list(VARIANTS)
            rng.shuffle(order)
            for v in order:
                set_variant(t, v)
                runs[v].append(block(t, args.steps))
        m = {k: statistics.median(v) for k, v in runs.items()}
        off = m["off"]
        act = (m["every=1"] - m["every=1 no activations"]) / off
        noise = (m["every=1"] - m["every=1 no noise"]) / off
        layers = (m["every=1"] - off) / off - act - noise
        print(
            f"{task:8} {off:7.2f} {m['default']:8.2f} {m['default'] / off:8.3f} {m['off again'] / off:6.3f} "
            f"{m['keep only'] / off:9.3f} {m['every=1'] / off:12.3f} {act:+12.1%} {noise:+7.1%} {layers:+7.1%}"
        )
        t.backend.close()
        t.loader.close()


if __name__ == "__main__":
    main()
