"""What run health costs under fsdp: each rank's peak memory and the step time, health off against on.

    python bench/fsdp_health.py [--ranks 2] [--width 1024] [--depth 4] [--steps 24] [--repeat 3]

Every run is a real ``multilane train --strategy fsdp`` (bench/fsdp_memory.py's ``train``: the built-in
``mlp`` task with Adam, Gloo on CPU lanes, a log every 4 steps), ``--repeat`` rounds of the three runs
interleaved, each variant's median over the rounds. Variants:

- off: ``health.enabled = false``;
- default: health at its default cadence (``health.every = 50``: no sampled step in a short run), so
  what it costs is the NaN replay's copy of each rank's shards of the model and of Adam's state, kept
  at each log window's start;
- every step: ``health.every = 1``: per-layer health from the shards, the activations (GELU) and the
  noise scale's norm at each unit's reduce-scatter on every step, summed over the ranks at each log.

Each rank's peak resident memory is the kernel's ``VmHWM`` (on CPU lanes a rank's memory is its
process's); the step time is the run's median ``step_ms`` after the first log window.
"""

from __future__ import annotations

import argparse
import statistics

from fsdp_memory import per_device, step_ms, train

VARIANTS = {
    "off": ("health.enabled=false",),
    "default": (),
    "every step": ("health.every=1",),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every process")
    a = ap.parse_args()
    model = (f"task.params.width={a.width}", f"task.params.depth={a.depth}", "task.params.samples=4096")
    got: dict[str, list[tuple[float, float, float]]] = {name: [] for name in VARIANTS}
    for _ in range(a.repeat):
        for name, extra in VARIANTS.items():
            peaks: dict[int, int] = {}
            recs = train("fsdp", a.ranks, 0, 0, a.steps, a.threads, sets=(*model, *extra), peaks=peaks)
            shards = max(per_device(recs).values()) / 2**20
            got[name].append((max(peaks.values()) / 2**20, step_ms(recs), shards))
            noise = "noise" in recs[-1]
            print(f"  {name}: peak {got[name][-1][0]:.0f} MiB, {got[name][-1][1]:.1f} ms, noise {noise}", flush=True)
    print(f"\nmlp width {a.width} depth {a.depth}, Adam, fsdp on {a.ranks} CPU processes, {a.repeat} rounds")
    print(f"{'health':<12} | {'peak RSS per rank MiB':>21} | {'ratio':>5} | {'step ms':>7} | {'ratio':>5} | shards MiB")
    med = {name: [statistics.median(col) for col in zip(*rows, strict=True)] for name, rows in got.items()}
    peak0, ms0, _ = med["off"]
    for name, (peak, ms, shards) in med.items():
        print(f"{name:<12} | {peak:>21.0f} | {peak / peak0:>5.2f} | {ms:>7.1f} | {ms / ms0:>5.2f} | {shards:.2f}")


if __name__ == "__main__":
    main()
