"""Cost of per-lane random streams on two CPU lanes, before and after, side by side.

    python bench/lane_context_overhead.py [--rounds 300] [--calls]

"before" is the step with each lane's function called bare (as before per-lane streams), "after"
the engine's step (each lane in its context: its own random stream, an exchange group). Both train
the same model from the same weights on the same batches, step by step in a shuffled order. For a model without randomness the lanes run unlocked after the
first step (target: after / before <= 1.05); with dropout they run one forward at a time: that row
shows what reproducible dropout costs on this machine.

``--calls`` times the wrapper alone instead: ``parallel_apply`` of no-op functions on two lanes, bare
and through ``lane_apply``, the cost per call that no step time hides.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
from multilane.engine.config import build_config
from multilane.engine.parallel.strategy import ReplicateEachStep
from multilane.engine.run.trainer import Trainer
from multilane.engine.tasks import ArrayData, Task
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).parent))
from step_overhead import CASES, engine_step, interleaved, time_block


class Before(ReplicateEachStep):
    """The step with each lane's function called bare, as before per-lane streams (no lock, no probe,
    no exchange group). It still merges buffers: the models here have none, so that is a walk over
    the modules."""

    def _apply(self, kind: str, fns, inputs, kwargs, lanes) -> list[Any]:
        return self.backend.parallel_apply(fns, inputs, kwargs, lanes)


class DropoutMlp(Task):
    name = "dropout-mlp"

    def build_model(self) -> nn.Module:
        layers: list[nn.Module] = [nn.Linear(64, 256)]
        for _ in range(2):
            layers += [nn.ReLU(), nn.Dropout(0.1), nn.Linear(256, 256)]
        return nn.Sequential(*layers, nn.ReLU(), nn.Linear(256, 10))

    def data(self) -> ArrayData:
        g = torch.Generator().manual_seed(0)
        return ArrayData(torch.randn(4096, 64, generator=g), torch.randint(0, 10, (4096,), generator=g))

    def loss(self, output, target):
        return F.cross_entropy(output, target)


def trainer(case: dict, task: Task | None, before: bool) -> Trainer:
    cfg = build_config({**case, "devices": {"use": "cpu:0,cpu:1"}, "train": {"steps": 10**9, "log_every": 10}})
    t = Trainer(cfg, task=task)
    t._setup()
    if before:
        t.strategy = Before(t.backend, cfg.train.precision, seed=cfg.train.seed)
    return t


def per_call(rounds: int = 20000) -> None:
    from multilane.engine.parallel import make_backend
    from multilane.engine.parallel.replicas.lane_context import lane_apply
    from multilane.engine.parallel.replicas.lane_rng import LaneRandom
    from multilane.engine.telemetry.devices import parse_devices

    backend = make_backend(parse_devices("cpu:0,cpu:1"))
    random = LaneRandom([torch.device("cpu")] * 2)
    fns, inputs = [lambda: None] * 2, [(), ()]
    bare = lambda: backend.parallel_apply(fns, inputs, None, [0, 1])  # noqa: E731
    wrapped = lambda: lane_apply(backend.parallel_apply, random, "k", fns, inputs, None, [0, 1], ["a", "b"])  # noqa: E731
    for fn in (bare, wrapped):
        time_block(fn, 200)
    m = interleaved({"bare": bare, "lane_apply": wrapped}, rounds)
    backend.close()
    print(
        f"parallel_apply of 2 no-op lanes, median of {rounds}: bare {m['bare'] * 1000:.1f} µs, "
        f"through lane_apply {m['lane_apply'] * 1000:.1f} µs (+{(m['lane_apply'] - m['bare']) * 1000:.1f} µs per call)"
    )


def main() -> None:
    torch.set_flush_denormal(True)
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=300, help="steps of each loop, interleaved")
    ap.add_argument("--calls", action="store_true", help="time the per-call cost of lane_apply alone")
    args = ap.parse_args()
    if args.calls:
        per_call()
        return
    print(f"torch {torch.__version__}, 2 CPU lanes, {args.rounds} interleaved steps of each, median step time in ms\n")
    print("'before again' is a second, identical 'before' loop: its ratio (A/A) shows the noise floor.\n")
    print(f"{'case':26} {'before':>8} {'before again':>13} {'after':>8} {'ratio':>6} {'A/A':>6}")
    cases: list[tuple[str, dict, Task | None]] = [(name, case, None) for name, case in CASES.items()]
    cases.append(("mlp+dropout (batch 256)", {"data": {"batch_size": 256}}, DropoutMlp()))
    for name, case, task in cases:
        old, again, new = (trainer(case, task, before=b) for b in (True, True, False))
        fns = {"before": engine_step(old), "again": engine_step(again), "after": engine_step(new)}
        for fn in fns.values():
            time_block(fn, 10)  # warm-up (and the first, probing step)
        m = interleaved(fns, args.rounds)
        print(
            f"{name:26} {m['before']:8.3f} {m['again']:13.3f} {m['after']:8.3f} "
            f"{m['after'] / m['before']:6.3f} {m['again'] / m['before']:6.3f}"
        )
        for t in (old, again, new):
            t.backend.close()


if __name__ == "__main__":
    main()
