"""What health costs: step time with health at its default cadence against health off, under every
strategy and in the Lightning and Hugging Face recorders.

    python bench/health_overhead.py [--rounds 6] [--steps 100] [--tasks digits,charlm]
        [--strategies replicate,persistent,ddp,fsdp] [--recorders lightning,hf] [--runs 3]

**In one process** (replicate, persistent): one trainer per task and strategy on two CPU lanes (charlm
small enough for a bench: context 64, width 64, batch 16); blocks of ``--steps`` steps run the trainer's
own step, log every 10 steps and keep the replay state at each log window's start, as ``Trainer._loop``
does. Each round runs every variant once, in a shuffled order, so machine noise lands on all alike; a
second "off" block gives the noise floor (A/A). Variants:

- off: ``health.enabled = false`` (no sampling, no noise scale, no replay state);
- default: the ``health`` section as shipped (layers every 50 steps, the noise scale every 4, the replay
  state kept at every log window);
- keep only: the replay state kept, nothing sampled (the cost of "where a NaN began" on finite steps);
- noise every step: the lanes' squared norms at every step, nothing else sampled;
- every=1: everything at every step.

**In processes** (ddp, fsdp on two CPU ranks, the digits CNN; Lightning's ddp and the Hugging Face Trainer's ddp, two
processes each, on the tests' own scripts): ``--runs`` rounds of whole runs, health default and off (and
off again; for ddp and fsdp also health without the noise scale) in a shuffled order, each run's median ``step_ms`` over its train records after the first
fifth (its start), the medians of the rounds compared. Wall time, so a busy machine's noise lands here
in full: the A/A column says how much.

Goal: default / off within 2 % of step time, everywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from multilane.engine.config import build_config
from multilane.engine.health.run_health import RunHealth, make_monitor
from multilane.engine.run.energy import EnergyMeter
from multilane.engine.run.trainer import Trainer

TASKS = {
    "digits": ({"name": "digits"}, 64),
    "charlm": ({"name": "charlm", "params": {"context": 64, "width": 64, "sample_bytes": 0}}, 16),
}


ROOT = Path(__file__).resolve().parent.parent


def trainer(task: str, strategy: str = "replicate") -> Trainer:
    spec, batch = TASKS[task]
    cfg = build_config(
        {
            "task": spec,
            "data": {"batch_size": batch, "workers": 0},
            "devices": {"use": "cpu:0,cpu:1", "strategy": strategy},
            "train": {"steps": 10**9, "log_every": 10},
            "telemetry": {"enabled": False},
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
    elif variant == "noise every step":
        h.every, h.noise_every = 10**12, 1
    elif variant == "every=1":
        h.every = h.noise_every = 1
    t.config = t.config.model_copy(update={"health": h})
    t.health = make_monitor(
        t.config.health, t.task, t._loss_weight is not None, len(t.devices), t.backend.output_device
    )
    t.strategy.lane_grads = t.health.probe
    t.run_health = RunHealth(t.health, t.spread.replay(t) if keep else None, t._event, t.callbacks)


def block(t: Trainer, steps: int) -> float:
    """CPU milliseconds (this process, every thread) per step over ``steps`` steps (sampling, logging
    and keeping included): on a machine shared with other work, CPU time is what the variants change;
    wall time also counts the others' load."""
    t0 = time.process_time()
    for _ in range(steps):
        if t.window.steps == 0:
            t.run_health.window_start(t.step)
        t.spread.train_step(t, 1)
        t.step += 1
        if t.step % 10 == 0:
            t._log()
    return 1000 * (time.process_time() - t0) / steps


VARIANTS = ["off", "default", "off again", "keep only", "noise every step", "every=1"]


def in_process(args: argparse.Namespace, strategies: list[str]) -> None:
    rng = random.Random(0)
    print(
        f"{'strategy':11} {'task':8} {'off ms':>7} {'default':>8} {'def/off':>8} {'A/A':>6} {'keep/off':>9} "
        f"{'noise@1/off':>12} {'every=1/off':>12}"
    )
    for strategy in strategies:
        for task in args.tasks.split(","):
            t = trainer(task, strategy)
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
            print(
                f"{strategy:11} {task:8} {off:7.2f} {m['default']:8.2f} {m['default'] / off:8.3f} "
                f"{m['off again'] / off:6.3f} {m['keep only'] / off:9.3f} {m['noise every step'] / off:12.3f} "
                f"{m['every=1'] / off:12.3f}",
                flush=True,
            )
            t.backend.close()
            t.loader.close()


def _native(strategy: str, steps: int, health: bool | str, where: Path) -> list[str]:
    """A native run on two CPU ranks (ddp, fsdp): the digits CNN, batch 64, as the in-process bench."""
    cfg = {
        "task": TASKS["digits"][0],
        "data": {"batch_size": 64, "workers": 0},
        "devices": {"use": "cpu:0,cpu:1", "strategy": strategy},
        "train": {"steps": steps, "log_every": 10, "eval_every": 0},
        "health": {"enabled": bool(health), **({"noise_every": 10**12} if health == "no noise" else {})},
        "telemetry": {"enabled": False},
        "run": {"runs_dir": str(where / "runs")},
    }
    (where / "config.json").write_text(json.dumps(cfg))
    return [sys.executable, "-m", "multilane.engine.cli", "train", "--config", str(where / "config.json")]


def _recorder(kind: str, steps: int, health: bool, where: Path) -> list[str]:
    """The tests' Lightning or Hugging Face script, ddp on two processes, health default or off (-1)."""
    every = "0" if health else "-1"
    common = ["--runs-dir", str(where / "runs"), "--out", str(where / "out"), "--steps", str(steps)]
    if kind == "lightning":
        script = ROOT / "tests" / "integrations" / "lightning_script.py"
        return [sys.executable, str(script), *common, "--devices", "2", "--health-every", every]
    script = ROOT / "tests" / "integrations" / "transformers_script.py"
    from multilane.engine.distributed.launcher import free_port

    port = ["--master_addr", "127.0.0.1", "--master_port", str(free_port())]  # torchrun's 0 is no free port
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", *port]
    return [*launch, str(script), *common, "--model", "mlp", "--samples", str(16 * steps), "--health-every", every]


def _step_ms(cmd: list[str], where: Path) -> float:
    """Run ``cmd`` to its end; the median ``step_ms`` of its train records after the first fifth."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(cmd, cwd=where, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])}… failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    (metrics,) = (where / "runs").glob("*/metrics.jsonl")
    recs = [json.loads(x) for x in metrics.read_text().splitlines()]
    ms = [r["step_ms"] for r in recs if r.get("kind") == "train" and r.get("step_ms")]
    return statistics.median(ms[len(ms) // 5 :])


def in_processes(args: argparse.Namespace, kinds: list[str]) -> None:
    rng = random.Random(1)
    print(
        f"\n{'run':11} {'steps':>6} {'off ms':>7} {'default':>8} {'def/off':>8} {'A/A':>6} {'no-noise/off':>13}"
        "   (wall ms/step, medians)"
    )
    for kind in kinds:
        steps = args.process_steps
        runs: dict[str, list[float]] = {"off": [], "default": [], "off again": []}
        if kind in ("ddp", "fsdp"):
            runs["no noise"] = []  # health as shipped but the noise scale: what the noise scale adds
        for _ in range(args.runs):
            order = list(runs)
            rng.shuffle(order)
            for v in order:
                with tempfile.TemporaryDirectory() as tmp:
                    where = Path(tmp)
                    health = "no noise" if v == "no noise" else v == "default"
                    if kind in ("ddp", "fsdp"):
                        cmd = _native(kind, steps, health, where)
                    else:
                        cmd = _recorder(kind, steps, health, where)
                    runs[v].append(_step_ms(cmd, where))
        m = {k: statistics.median(v) for k, v in runs.items()}
        off = m["off"]
        print(
            f"{kind:11} {steps:6d} {off:7.2f} {m['default']:8.2f} {m['default'] / off:8.3f} {m['off again'] / off:6.3f}"
            + (f" {m['no noise'] / off:13.3f}" if "no noise" in m else ""),
            flush=True,
        )


def main() -> None:
    torch.set_flush_denormal(True)
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--tasks", default="digits,charlm")
    ap.add_argument("--strategies", default="replicate,persistent,ddp,fsdp")
    ap.add_argument("--recorders", default="lightning,hf")
    ap.add_argument("--runs", type=int, default=3, help="rounds of whole runs for ddp, fsdp and the recorders")
    ap.add_argument("--process-steps", type=int, default=200)
    args = ap.parse_args()
    h = build_config({}).health
    print(
        f"torch {torch.__version__}; two CPU lanes or ranks (digits: batch 64; charlm context 64, width 64, batch 16), "
        f"log every 10 steps; health as shipped: every={h.every}, noise_every={h.noise_every}; {args.rounds} rounds "
        f"of one {args.steps}-step block per variant, shuffled; medians of CPU ms/step\n"
    )
    strategies = [s for s in args.strategies.split(",") if s]
    local = [s for s in strategies if s in ("replicate", "persistent")]
    if local:
        in_process(args, local)
    kinds = [s for s in strategies if s in ("ddp", "fsdp")] + [r for r in args.recorders.split(",") if r]
    if kinds:
        in_processes(args, kinds)


if __name__ == "__main__":
    main()
