"""The GPU check: everything of the CUDA path that CI cannot run, in one call, under 5 minutes on one GPU.

    python bench/gpu_check.py              # on a GPU machine (docs/gpu-verification.md: the device call)
    python bench/gpu_check.py --dry-run    # the same checks on CPU lanes (cpu:0,cpu:1), Gloo for ddp

Checks (bench/gpu_checks/, one module each): the environment; correctness of every strategy
(replicate, persistent, ddp, fsdp) against one device and the whole batch, on [cuda:0] and
[cuda:0, cuda:0], float32 and bf16, with BatchNorm and dropout under checkpointing among the models;
speed of each strategy against nn.DataParallel and DDP with the MLP step's TFLOP/s against the
card's bf16 rate; NVML telemetry against nvidia-smi; a real out-of-memory reported with its hint and
a following run that succeeds. The dry run skips, and marks, what only a GPU has.

Each check runs in its own process with a timeout: a crash, a hang or a CUDA error in one is a
failed row, and the rest still run. One table at the end; the same as JSON in ``$OUT/gpu_check.json``
when ``OUT`` is set (the device tool brings ``$OUT`` back), and in ``--json`` if given. Exit 0 when no
row failed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "gpu_checks"))
sys.path.insert(1, str(HERE))  # bench/timing.py

# name -> (module, argument, needs a GPU, timeout in seconds on a GPU / in the dry run)
CHECKS: dict[str, tuple[str, str | None, bool, tuple[int, int]]] = {
    "environment": ("environment", None, False, (60, 120)),
    "correctness replicate": ("correctness", "replicate", False, (120, 240)),
    "correctness persistent": ("correctness", "persistent", False, (120, 240)),
    "out of memory": ("oom", None, True, (60, 60)),
    "telemetry": ("telemetry", None, True, (60, 60)),
    "speed": ("speed", None, False, (180, 240)),
    "correctness ddp": ("correctness", "ddp", False, (180, 240)),
    "correctness fsdp": ("correctness", "fsdp", False, (180, 240)),
}
"""In the order they run: the slowest (ddp starts processes for every run) last, so that a check that
outruns the budget costs the least."""
GPU_BUDGET_S = 290  # the whole check, under 5 minutes on one GPU
DRY_BUDGET_S = 900  # the dry run's safety net: generous, for a loaded CI machine (a quiet one takes about a minute)


def run_child(name: str, dry_run: bool, workdir: Path, result: Path) -> None:
    """One check, in this process (the driver starts one process per check); its rows go to ``result``
    as they come (``Context.add``)."""
    from common import FAIL, Context, Row

    module, arg, _, _ = CHECKS[name]
    ctx = Context(dry_run=dry_run, workdir=workdir, result=result)
    try:
        mod = __import__(module)
        mod.run(ctx, arg) if arg is not None else mod.run(ctx)
    except BaseException as e:  # a check's own bug is its failed row, with where it happened
        tb = traceback.format_exc().strip().splitlines()
        ctx.add(
            Row(name, "(the check itself)", f"{type(e).__name__}: {e}"[:200], "no error", FAIL, {"traceback": tb[-12:]})
        )


def run_check(name: str, dry_run: bool, workdir: Path, timeout: float) -> dict:
    """Run one check in its own process group (ddp's ranks included) and read back its rows."""
    result = workdir / f"{name.replace(' ', '_')}.json"
    cmd = [sys.executable, __file__, "--child", name, "--workdir", str(workdir), "--result", str(result)]
    if dry_run:
        cmd.append("--dry-run")
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        kill_tree(p.pid)
        out, err = p.communicate()
        timed_out = True
    seconds = time.monotonic() - t0
    tail = [ln for ln in (err or "").strip().splitlines() if ln.strip()][-8:]
    rows = json.loads(result.read_text())["rows"] if result.exists() else []  # written whole (os.replace)
    if timed_out or p.returncode != 0:
        why = f"timed out after {timeout:.0f} s" if timed_out else f"the check's process died (exit {p.returncode})"
        row = {"check": name, "case": "(the check itself)", "measured": why, "expected": "a result", "status": "fail"}
        row["data"] = {"stderr_tail": tail, "stdout_tail": (out or "").strip().splitlines()[-4:]}
        rows.append(row)
    return {"name": name, "seconds": round(seconds, 1), "rows": rows, "stderr_tail": tail}


def kill_tree(pid: int) -> None:
    """Kill a check's process, its group, and every descendant: torch's elastic agent starts the ddp
    ranks in sessions of their own, which a process-group kill does not reach."""
    try:
        import psutil

        descendants = psutil.Process(pid).children(recursive=True)
    except Exception:
        descendants = []
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    for child in descendants:
        with contextlib.suppress(Exception):
            child.kill()


def print_table(results: list[dict], header: str) -> None:
    rows = [r for res in results for r in res["rows"]]
    try:
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table
    except ImportError:
        print(header)
        for r in rows:
            print(f"{r['status']:5} | {r['check']:24} | {r['case']:40} | {r['measured']:40} | {r['expected']}")
        return
    table = Table(title=header, show_lines=False)
    for col in ("status", "check", "case", "measured", "expected"):
        table.add_column(col, overflow="fold")
    colours = {"pass": "green", "fail": "bold red", "skip": "dim", "info": "cyan", "known": "yellow"}
    for r in rows:
        cells = [escape(str(r[k])) for k in ("check", "case", "measured", "expected")]
        table.add_row(f"[{colours.get(r['status'], 'white')}]{r['status']}[/]", *cells)
    Console(width=200).print(table)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU lanes for the GPU, Gloo for ddp; skip GPU-only checks")
    ap.add_argument("--only", action="append", choices=list(CHECKS), help="run only this check (repeatable)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--budget", type=float, help="seconds for the whole check (default: 290 on a GPU)")
    ap.add_argument("--child", choices=list(CHECKS), help=argparse.SUPPRESS)
    ap.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        run_child(args.child, args.dry_run, args.workdir, args.result)
        return 0
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            print("gpu_check: error: no CUDA GPU here; use --dry-run for the CPU-lane rehearsal", file=sys.stderr)
            return 2
    budget = args.budget or (DRY_BUDGET_S if args.dry_run else GPU_BUDGET_S)
    start = time.monotonic()
    results = []
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        for name in args.only or list(CHECKS):
            _, _, gpu_only, (t_gpu, t_dry) = CHECKS[name]
            left = budget - (time.monotonic() - start)
            if args.dry_run and gpu_only:
                row = {"check": name, "case": "all", "measured": "-", "expected": "GPU only", "status": "skip"}
                results.append({"name": name, "seconds": 0.0, "rows": [row]})
                continue
            if left < 10:
                row = {"check": name, "case": "all", "measured": "-", "expected": "no time left", "status": "fail"}
                results.append({"name": name, "seconds": 0.0, "rows": [row]})
                continue
            workdir = Path(tmp) / name.replace(" ", "_")
            workdir.mkdir()
            res = run_check(name, args.dry_run, workdir, min(t_dry if args.dry_run else t_gpu, left))
            results.append(res)
            print(
                f"{name}: {res['seconds']:.1f} s, " + ", ".join(sorted({r["status"] for r in res["rows"]})), flush=True
            )
    total = time.monotonic() - start
    statuses = [r["status"] for res in results for r in res["rows"]]
    counts = {s: statuses.count(s) for s in ("pass", "fail", "known", "skip", "info")}
    mode = "dry run on CPU lanes" if args.dry_run else "GPU"
    header = f"gpu_check ({mode}) in {total:.0f} s: " + ", ".join(f"{v} {k}" for k, v in counts.items() if v)
    report = {
        "mode": "dry-run" if args.dry_run else "gpu",
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "seconds": round(total, 1),
        "counts": counts,
        "checks": results,
    }
    targets = [args.json] if args.json else []
    if os.environ.get("OUT"):
        targets.append(Path(os.environ["OUT"]) / "gpu_check.json")
    for path in targets:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1, default=str))
    print_table(results, header)
    return 1 if counts["fail"] else 0


if __name__ == "__main__":
    sys.exit(main())
