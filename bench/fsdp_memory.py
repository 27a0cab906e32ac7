"""What fsdp saves, and what it costs: per-device bytes and step time against replicate and ddp.

    python bench/fsdp_memory.py [--width 1024] [--depth 4] [--steps 24] [--ranks 2 4]
    python bench/fsdp_memory.py --cap
    python bench/fsdp_memory.py --options [--ranks 2] [--steps 12] [--width 256] [--context 256] [--batch 32] [--repeat 2]

Every run is a real ``multilane train`` (subprocess; ddp and fsdp through the elastic launcher, Gloo
on CPU lanes) of the built-in ``mlp`` task with Adam; the numbers are the engine's own (the train
records' ``memory`` and ``step_ms``), read from the run folders.

1. Memory: each device's parameter + gradient + optimizer-state bytes under fsdp on N processes,
   against 1/N of replicate's on one device (the goal: within 5 %). FSDP shards each tensor along
   dim 0 in N near-equal pieces, so the largest shard is at most one row per tensor over 1/N.
2. Step time: fsdp against ddp on the same job and the same N (median ``step_ms`` after the first
   log window). On CPU lanes both are dominated by Gloo's collectives over loopback; fsdp does two
   all-gathers (forward, backward) and one reduce-scatter per unit and step where ddp does one
   bucketed all-reduce, so fsdp is expected to be slower here: the table says by how much.
3. ``--cap``: a model whose parameters, gradients and Adam state do not fit a per-process memory cap
   (``RLIMIT_AS``, the address space, set on the launcher and so on every rank): replicate on one
   device fails with one line; fsdp on 4 processes trains under the same cap. The cap is the address
   space a rank needs for torch itself (measured: a small run's peak) plus 0.7 of the model's bytes.
4. ``--options``: fsdp's options (``devices.fsdp_activation_checkpointing``, ``devices.fsdp_cpu_offload``,
   both) against none on the charlm transformer (width 256, context 256, batch 32 unless told): each
   rank's peak resident memory (the kernel's ``VmHWM``: on CPU lanes a rank's memory is its process's)
   and the median step time, each as a ratio to the run without options, side by side (``--repeat``
   rounds of the four runs, interleaved; each option's median over them, and its fastest round: on a
   machine shared with other jobs the least disturbed).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from multilane.engine.rundir.runlog import read_metrics

PARTS = ("params", "grads", "optimizer")


class RunFailed(RuntimeError):
    pass


def train(
    strategy: str,
    ranks: int,
    width: int,
    depth: int,
    steps: int,
    threads: int,
    cap: int | None = None,
    *,
    task: str = "mlp",
    sets: tuple[str, ...] | None = None,
    batch: int = 128,
    peaks: dict[int, int] | None = None,
) -> list[dict]:
    """The train records of one run (``cap``: RLIMIT_AS in bytes for every process of it; ``sets``:
    the task's ``--set`` keys instead of the mlp's; ``peaks``: filled with each rank's peak RSS)."""
    with tempfile.TemporaryDirectory() as tmp:
        devices = ",".join(f"cpu:{i}" for i in range(ranks))
        args = [sys.executable, "-m", "multilane.engine.cli", "train", "--task", task, "--steps", str(steps)]
        args += ["--devices", devices, "--strategy", strategy, "--runs-dir", tmp, "--batch-size", str(batch)]
        if sets is None:
            sets = (f"task.params.width={width}", f"task.params.depth={depth}", "task.params.samples=4096")
        for s in (
            *sets,
            "optim.name=adam",
            "train.log_every=4",
            "train.eval_every=0",
            "train.checkpoint_every=0",
            "telemetry.enabled=false",
        ):
            args += ["--set", s]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        limit = None if cap is None else (lambda: resource.setrlimit(resource.RLIMIT_AS, (cap, cap)))
        with RankPeaks(peaks):
            r = subprocess.run(args, capture_output=True, text=True, timeout=1200, env=env, preexec_fn=limit)
        runs = [p for p in Path(tmp).iterdir() if p.is_dir()]
        if r.returncode != 0:  # the run's own one line (status.json), else the last line it printed
            status = json.loads((runs[0] / "status.json").read_text()) if runs else {}
            lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
            line = status.get("message") or (lines[-1] if lines else "")
            raise RunFailed(f"exit {r.returncode}: {line}"[:400])
        (run,) = runs
        return [rec for rec in read_metrics(run) if rec["kind"] == "train"]


class RankPeaks:
    """While a run runs: each rank's peak resident memory (the kernel's ``VmHWM``, read every 50 ms
    from the rank processes, which name themselves ``multilane rank R/N: ...``)."""

    def __init__(self, peaks: dict[int, int] | None) -> None:
        self.peaks = peaks

    def __enter__(self) -> RankPeaks:
        import threading

        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        if self.peaks is not None:
            self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join()

    def _watch(self) -> None:
        import psutil

        assert self.peaks is not None
        ranks: dict[int, int] = {}
        me = psutil.Process()
        while not self.stop.is_set():
            for c in me.children(recursive=True):
                try:
                    if c.pid not in ranks:  # a rank names itself (soon after it starts): "multilane rank R/N: ..."
                        words = c.cmdline()[:3]
                        if words[:2] != ["multilane", "rank"] or len(words) < 3:
                            continue
                        ranks[c.pid] = int(words[2].split("/")[0])
                    rank = ranks[c.pid]
                    with open(f"/proc/{c.pid}/status") as f:
                        hwm = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmHWM:"))
                    self.peaks[rank] = max(self.peaks.get(rank, 0), hwm)
                except (psutil.Error, OSError, StopIteration, ValueError):
                    pass
            self.stop.wait(0.05)


def per_device(records: list[dict]) -> dict[str, int]:
    """Each device's parameter + gradient + optimizer bytes at the last log."""
    return {k: sum(m[p] for p in PARTS) for k, m in records[-1]["memory"].items()}


def step_ms(records: list[dict]) -> float:
    return statistics.median(r["step_ms"] for r in records[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every process")
    ap.add_argument("--cap", action="store_true", help="only part 3: the memory cap")
    ap.add_argument("--options", action="store_true", help="only part 4: fsdp's options (charlm, --ranks' first)")
    ap.add_argument("--context", type=int, default=256, help="--options: charlm's context")
    ap.add_argument("--batch", type=int, default=32, help="--options: the batch")
    ap.add_argument("--repeat", type=int, default=2, help="--options: rounds of the four runs")
    a = ap.parse_args()
    if a.cap:
        return cap_demo(a.threads)
    if a.options:
        width = 256 if a.width == 1024 else a.width
        return options_table(
            a.threads, a.steps if a.steps != 24 else 12, a.ranks[0], width, a.context, a.batch, a.repeat
        )
    one = per_device(train("replicate", 1, a.width, a.depth, 4, a.threads))
    (ref,) = one.values()
    print(
        f"mlp width {a.width} depth {a.depth}, Adam: one device holds {ref / 2**20:.2f} MiB of parameters + gradients + optimizer state"
    )
    print()
    print(
        f"{'N':>2} | {'fsdp largest device MiB':>23} | {'replicate / N MiB':>17} | {'ratio':>6} | {'within 5 %':>10} | {'ddp per device MiB':>18}"
    )
    rows = []
    for n in a.ranks:
        fsdp = train("fsdp", n, a.width, a.depth, a.steps, a.threads)
        ddp = train("ddp", n, a.width, a.depth, a.steps, a.threads)
        largest, ideal = max(per_device(fsdp).values()), ref / n
        ratio = largest / ideal
        print(
            f"{n:>2} | {largest / 2**20:>23.3f} | {ideal / 2**20:>17.3f} | {ratio:>6.4f} | {'yes' if ratio <= 1.05 else 'NO':>10} | "
            f"{max(per_device(ddp).values()) / 2**20:>18.3f}"
        )
        rows.append((n, step_ms(fsdp), step_ms(ddp)))
    print()
    print(
        f"{'N':>2} | {'fsdp step ms':>12} | {'ddp step ms':>11} | {'fsdp / ddp':>10}   (CPU lanes, Gloo; median after the first window)"
    )
    for n, f, d in rows:
        print(f"{n:>2} | {f:>12.1f} | {d:>11.1f} | {f / d:>10.2f}")


OPTIONS = {
    "off": (),
    "activation checkpointing": ("devices.fsdp_activation_checkpointing=true",),
    "CPU offload": ("devices.fsdp_cpu_offload=true",),
    "both": ("devices.fsdp_activation_checkpointing=true", "devices.fsdp_cpu_offload=true"),
}
CHARLM = ("task.params.layers=4", "task.params.heads=4", "task.params.dropout=0.0", "task.params.sample_bytes=0")


def options_table(threads: int, steps: int, ranks: int, width: int, context: int, batch: int, repeat: int) -> None:
    """Part 4: fsdp's options on the charlm transformer on ``ranks`` CPU processes, ``repeat`` rounds of
    the four runs (interleaved, so that a loaded machine's drift falls on every option alike); each
    option's median over the rounds."""
    sets = (*CHARLM, f"task.params.width={width}", f"task.params.context={context}")
    base: dict[int, int] = {}
    train("fsdp", ranks, 64, 1, 3, threads, peaks=base)  # a rank with next to no model: torch, Gloo, the engine
    print(
        f"charlm width {width}, 4 layers, context {context}, batch {batch}, Adam, fsdp on {ranks} CPU processes, "
        f"{repeat} rounds; a rank's peak RSS with next to no model: {max(base.values()) / 2**20:.0f} MiB"
    )
    got: dict[str, list[tuple[float, float, float]]] = {name: [] for name in OPTIONS}
    for _ in range(repeat):
        for name, extra in OPTIONS.items():
            peaks: dict[int, int] = {}
            recs = train(
                "fsdp", ranks, 0, 0, steps, threads, task="charlm", sets=(*sets, *extra), batch=batch, peaks=peaks
            )
            got[name].append((max(peaks.values()) / 2**20, step_ms(recs), max(per_device(recs).values()) / 2**20))
            print(f"  {name}: peak {got[name][-1][0]:.0f} MiB, {got[name][-1][1]:.1f} ms", flush=True)
    print()
    print(
        f"{'option':<24} | {'peak RSS per rank MiB':>21} | {'ratio':>5} | {'step ms':>7} | {'ratio':>5} | "
        f"{'fastest round ms':>16} | {'ratio':>5} | {'shards per rank MiB':>19}"
    )
    med = {name: [statistics.median(col) for col in zip(*rows, strict=True)] for name, rows in got.items()}
    low = {name: min(ms for _, ms, _ in rows) for name, rows in got.items()}
    peak0, ms0, _ = med["off"]
    for name, (peak, ms, shards) in med.items():
        print(
            f"{name:<24} | {peak:>21.0f} | {peak / peak0:>5.2f} | {ms:>7.1f} | {ms / ms0:>5.2f} | "
            f"{low[name]:>16.1f} | {low[name] / low['off']:>5.2f} | {shards:>19.2f}"
        )


def peak_address_space(strategy: str, ranks: int, threads: int) -> int:
    """The largest VmPeak among a small run's processes (torch, Gloo and the engine, without a model
    to speak of): what a rank needs before its model."""
    import threading
    import time

    import psutil

    peak = [0]
    stop = threading.Event()

    def watch() -> None:
        me = psutil.Process()
        while not stop.is_set():
            for c in me.children(recursive=True):
                try:
                    peak[0] = max(peak[0], c.memory_info().vms)
                except psutil.Error:
                    pass
            time.sleep(0.05)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        train(strategy, ranks, 64, 1, 3, threads)
    finally:
        stop.set()
        t.join()
    return peak[0]


def cap_demo(threads: int, width: int = 4096, depth: int = 4) -> None:
    model_bytes = 4 * (4 * (64 * width + width * width * (depth - 1) + width * 10))  # fp32: params, grads, Adam x2
    base = peak_address_space("fsdp", 4, threads)
    cap = base + int(0.7 * model_bytes)
    print(f"mlp width {width} depth {depth}: parameters + gradients + Adam state {model_bytes / 2**30:.2f} GiB")
    print(
        f"RLIMIT_AS per process: {cap / 2**30:.2f} GiB (a small fsdp rank's peak {base / 2**30:.2f} GiB + 0.7 of the model)"
    )
    for strategy, ranks in (("replicate", 1), ("fsdp", 4)):
        try:
            recs = train(strategy, ranks, width, depth, 3, threads, cap=cap)
            largest = max(sum(m[p] for p in PARTS) for m in recs[-1]["memory"].values())
            print(
                f"  {strategy} on {ranks}: trained 3 steps; largest device holds {largest / 2**30:.2f} GiB of the three"
            )
        except RunFailed as e:
            print(f"  {strategy} on {ranks}: FAILED: {e}")


if __name__ == "__main__":
    main()
