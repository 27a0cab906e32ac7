"""Engine step time on one CPU lane against a plain hand-written PyTorch loop, side by side.

    python bench/step_overhead.py [--rounds 600] [--cases digits,mlp]

Both loops train the same model from the same weights on the same batches (fetched the same way), with
the same optimizer, accumulation and clipping (the config's: the plain loop is what a user would write
for it). They take turns step by step, in a shuffled order each round, so that drift on a shared machine hits
all alike. The ratio is median engine step time / median plain step time; the target is <= 1.05 (the
redesign's goal: <= 1.03 on the small models). "mean ratio" is the same with each loop's mean step (its
slowest 2 % of steps left out: the machine's hiccups): it counts the step that logs, one in 10, which the
median leaves out (the engine builds a record and takes the gradient norm there; the plain loop only
reads its loss).
"""

from __future__ import annotations

import argparse
import statistics
import time

import timing
import torch
from multilane.engine.config import build_config
from multilane.engine.run.energy import EnergyMeter
from multilane.engine.run.trainer import Trainer
from multilane.engine.tensors.optim import build_optimizer

DIGITS = {"task": {"name": "digits"}, "data": {"batch_size": 64}}
CASES = {
    "digits (CNN, batch 64)": DIGITS,
    # the settings that change the step's shape: the plain loop does the same (``plain_loop``)
    "digits + grad_accum 2": {**DIGITS, "train": {"grad_accum": 2}},
    "digits + grad_clip 1": {**DIGITS, "train": {"grad_clip": 1.0}},
    "digits + SGD momentum 0.9": {**DIGITS, "optim": {"name": "sgd", "momentum": 0.9}},
    "mlp (256x3, batch 256)": {"task": {"name": "mlp"}, "data": {"batch_size": 256}},
    "mlp (1024x4, batch 512)": {
        "task": {"name": "mlp", "params": {"width": 1024, "depth": 4, "features": 256}},
        "data": {"batch_size": 512},
    },
    # a step that is almost all overhead: the difference in µs is the loop's own cost
    "mlp (8x1, batch 8)": {
        "task": {"name": "mlp", "params": {"width": 8, "depth": 1, "features": 8}},
        "data": {"batch_size": 8},
    },
}


def engine(case: dict, devices: str) -> Trainer:
    train = {"steps": 10**9, "log_every": 10, **case.get("train", {})}  # a case may set grad_accum, grad_clip
    cfg = build_config({**case, "devices": {"use": devices}, "train": train})
    t = Trainer(cfg)
    t._setup()
    t.energy = EnergyMeter(None)  # what Trainer._run sets up before the loop (no telemetry here)
    return t


def plain_loop(trainer: Trainer):
    """The loop a user would write by hand for the same config: forward, loss, backward (``accum``
    micro-batches), the gradient clipped where the config clips, the optimizer's step."""
    cfg = trainer.config
    model = trainer.task.build_model()
    model.load_state_dict(trainer.model.state_dict())
    opt = build_optimizer(model.parameters(), cfg.optim)  # torch's own, with the config's settings
    loss_fn, batches = trainer.task.loss, trainer.loader.batches
    accum, clip = cfg.train.grad_accum, cfg.train.grad_clip
    state = {"m": 0, "steps": 0, "sum": torch.zeros(())}

    def step() -> None:
        for k in range(accum):
            x, y, _ = batches.get(state["m"])
            state["m"] += 1
            loss = loss_fn(model(x), y)
            if k == 0:
                opt.zero_grad(set_to_none=True)
            (loss / accum if accum > 1 else loss).backward()
            state["sum"] += loss.detach()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        state["steps"] += 1
        if state["steps"] % 10 == 0:
            state["sum"].item()  # the same log-time sync the engine does

    return step


def engine_step(trainer: Trainer):
    accum = trainer.config.train.grad_accum

    def step() -> None:
        trainer.spread.train_step(trainer, accum)
        trainer.step += 1
        if trainer.step % 10 == 0:
            trainer._log()

    trainer.callbacks = []
    trainer.window.reset()
    return step


def time_block(fn, steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - t0) / steps


def interleaved(fns: dict, rounds: int, seed: int = 0) -> dict[str, float]:
    """``timing.interleaved`` in milliseconds."""
    return {k: v * 1000 for k, v in timing.interleaved(fns, rounds, seed).items()}


def medians_and_means(fns: dict, rounds: int, seed: int = 0) -> tuple[dict[str, float], dict[str, float]]:
    """Each loop's median and trimmed mean step (``timing.trimmed_mean``) in milliseconds, from one run."""
    times = timing.step_times(fns, rounds, seed)
    med = {k: 1000 * statistics.median(v) for k, v in times.items()}
    return med, {k: 1000 * timing.trimmed_mean(v) for k, v in times.items()}


def main() -> None:
    # Adam on the CPU drives some gradients into denormal floats, which slow a backward pass up to
    # 15x and make timings depend on the exact values: flush them for every loop alike.
    torch.set_flush_denormal(True)
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=600, help="steps of each loop, interleaved")
    ap.add_argument("--cases", default="", help="only the cases whose names start with one of these (comma-separated)")
    args = ap.parse_args()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, {args.rounds} interleaved "
        "steps of each loop, median step time in ms"
    )
    print("'plain again' is a second, identical plain loop: its ratio shows the noise floor.\n")
    print(
        f"{'case':26} {'plain':>8} {'plain again':>12} {'engine 1 lane':>14} {'ratio':>6} {'A/A':>6} {'2 lanes':>8} "
        f"{'+µs':>8} {'mean ratio':>10}"
    )
    only = [c.strip() for c in args.cases.split(",") if c.strip()]
    for name, case in CASES.items():
        if only and not any(name.startswith(c) for c in only):
            continue
        tr = engine(case, "cpu:0")
        tr2 = engine(case, "cpu:0,cpu:1")
        fns = {"plain": plain_loop(tr), "again": plain_loop(tr), "engine": engine_step(tr)}
        for fn in fns.values():
            time_block(fn, 10)  # warm-up
        m, mean = medians_and_means(fns, args.rounds)
        # Measured apart: lane threads leave OpenMP workers spinning that would tax whichever loop
        # ran next. For information only (two lanes on a 2-core CPU share the same cores).
        lanes2 = engine_step(tr2)
        time_block(lanes2, 10)
        m["lanes2"] = interleaved({"lanes2": lanes2}, max(50, args.rounds // 4))["lanes2"]
        print(
            f"{name:26} {m['plain']:8.3f} {m['again']:12.3f} {m['engine']:14.3f} "
            f"{m['engine'] / m['plain']:6.3f} {m['again'] / m['plain']:6.3f} {m['lanes2']:8.3f} "
            f"{1000 * (m['engine'] - m['plain']):8.0f} {mean['engine'] / mean['plain']:10.3f}"
        )
        tr.backend.close()
        tr2.backend.close()


if __name__ == "__main__":
    main()
