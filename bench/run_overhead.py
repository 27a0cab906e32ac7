"""A whole run against a plain hand-written loop: what the loop pays beyond the strategy's step.

    python bench/run_overhead.py [--steps 2000] [--variants default,log50,quiet]

``bench/step_overhead.py`` times the step and the log; a real run also checks for a pause, a stop and a
timed checkpoint every step, and at each log window keeps the state a NaN's replay starts from, splits
the memory by kind, writes metrics.jsonl, and samples telemetry in a thread. Here a real
``Trainer.run()`` of digits (one CPU lane, its run folder in a temporary directory, ``eval_every = 0``)
runs with a plain loop interleaved step by step (the plain loop of ``step_overhead.py``, its own model
and optimizer on the same data): just before each of the run's steps, one plain step, so that the
machine's drift lands on both alike. A run's step is timed from its start to the next one's (the loop's
own work between steps included, the plain step taken out); the first ``log_every + 3`` steps are left
out (the peak meter counts tensors on steps 2, 3 and ``log_every + 2``: a one-time cost, shown apart).
Each call of the loop is also timed (a wrapper around it): what one step and one log window add.

Variants: ``default`` (the config as shipped: log every 10, health every 50, telemetry on); ``log50``
(``train.log_every = 50``); ``quiet`` (log every 50, health off, telemetry off).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
from multilane.engine.config import build_config
from multilane.engine.run.trainer import Trainer, TrainerCallback
from step_overhead import DIGITS, plain_loop

VARIANTS = {
    "default": {},
    "log50": {"train": {"log_every": 50}},
    "quiet": {"train": {"log_every": 50}, "health": {"enabled": False}, "telemetry": {"enabled": False}},
}
PER_STEP = ("control file", "pause/stop hold", "epoch", "timed checkpoint")
PER_WINDOW = ("replay's kept state", "record (_log)", "memory split", "metrics.jsonl")
LOOP_CALLS = {  # what the loop calls, by where it lives on the trainer: (attribute, method)
    "control file": ("spread", "sync_control"),
    "pause/stop hold": ("control", "wait_while_held"),
    "replay's kept state": ("run_health", "before_step"),
    "epoch": ("loader", "epoch_at"),
    "timed checkpoint": ("spread", "checkpoint_due"),
    "record (_log)": ("", "_log"),
    "memory split": ("spread", "memory"),
    "step": ("spread", "train_step"),
}


class Interleaved(TrainerCallback):
    """Once the run starts: a timer around each of the loop's calls, and one plain step before each of
    the run's steps."""

    def __init__(self, plain: Callable[[], None]) -> None:
        self.plain = plain
        self.calls: dict[str, list[float]] = collections.defaultdict(list)
        self.plain_s: list[float] = []
        self.starts: list[float] = []  # each run step's start (after its plain step)
        self.before: list[float] = []  # each plain step's start

    def on_train_start(self, trainer: Trainer) -> None:
        for label, (attr, name) in LOOP_CALLS.items():
            self._wrap(getattr(trainer, attr) if attr else trainer, name, label)
        for cb in trainer.callbacks:
            if type(cb).__name__ == "MetricsWriter":
                self._wrap(cb, "on_log", "metrics.jsonl")

    def _wrap(self, obj, name: str, label: str) -> None:
        f = getattr(obj, name)
        is_step = label == "step"

        def timed(*a, **k):
            if is_step:
                p0 = time.perf_counter()
                self.plain()
                self.before.append(p0)
                self.plain_s.append(time.perf_counter() - p0)
            t0 = time.perf_counter()
            if is_step:
                self.starts.append(t0)
            try:
                return f(*a, **k)
            finally:
                self.calls[label].append(time.perf_counter() - t0)

        setattr(obj, name, timed)

    def run_steps(self, skip: int) -> list[float]:
        """Each run step from its start to the next plain step's start (the loop's work between included)."""
        return [self.before[i + 1] - self.starts[i] for i in range(skip, len(self.starts) - 1)]

    def once(self, skip: int) -> float:
        """What the first ``skip`` run steps took beyond as many steady ones."""
        first = [self.before[i + 1] - self.starts[i] for i in range(skip)]
        return sum(first) - skip * statistics.fmean(self.run_steps(skip))


def run(variant: dict, steps: int, runs_dir: str) -> Interleaved:
    cfg = build_config(
        {
            **DIGITS,
            **variant,
            "devices": {"use": "cpu:0"},
            "train": {"steps": steps, "eval_every": 0, **variant.get("train", {})},
            "run": {"runs_dir": runs_dir},
        }
    )
    twin = Trainer(cfg)  # the plain loop's model, data and optimizer, built the way the run builds them
    twin._setup()
    probe = Interleaved(plain_loop(twin))
    result = Trainer(cfg, callbacks=[probe]).run()
    assert result.status == "finished", result.message
    twin.backend.close()
    return probe


def main() -> None:
    torch.set_flush_denormal(True)  # as step_overhead.py, for both alike
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    print(f"torch {torch.__version__}, digits (CNN, batch 64) on cpu:0, {args.steps} steps, a plain step before each")
    print("ms a step (a run's with the loop's work up to its next step); 'once': the first steps' extra, in s\n")
    print(
        f"{'variant':8} {'plain':>7} {'run':>7} {'mean ratio':>10} {'median ratio':>12} {'once':>5}"
        f"  per step beyond the step, µs | per log window, µs"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for name in [v.strip() for v in args.variants.split(",") if v.strip()]:
            skip = VARIANTS[name].get("train", {}).get("log_every", 10) + 3
            probe = run(VARIANTS[name], args.steps, tmp)
            steps, plain = probe.run_steps(skip), probe.plain_s[skip:-1]
            mean_p, mean_r = statistics.fmean(plain), statistics.fmean(steps)
            med = statistics.median(steps) / statistics.median(plain)
            calls = probe.calls
            per_step = sum(sum(calls[k]) for k in PER_STEP) / len(calls["step"])
            windows = max(1, len(calls["record (_log)"]))
            window = " ".join(f"{k} {1e6 * sum(calls[k]) / windows:.0f};" for k in PER_WINDOW)
            print(
                f"{name:8} {1e3 * mean_p:7.3f} {1e3 * mean_r:7.3f} {mean_r / mean_p:10.3f} {med:12.3f}"
                f" {probe.once(skip):5.2f}  {1e6 * per_step:5.1f} | {window}"
            )


if __name__ == "__main__":
    main()
