"""``multilane sweep`` and ``multilane sweep-worker``: a sweep's spec from the flags, its slots, a live rich
table of its trials, and the best trial's parameters and run folder at the end (engine/sweep/ does the work)."""

from __future__ import annotations

import argparse
import math
import signal
import sys
from typing import Any

from multilane.engine.cli.interrupts import answer_missed_ctrl_c
from multilane.engine.display.terminal_text import printable
from multilane.engine.errors import UserError

DEFAULT_TRIALS = 10
REFRESH_S = 0.5


def _base_config(args: argparse.Namespace, task: str) -> dict[str, Any]:
    """The nested config every trial starts from: --config, then --steps/--epochs/--batch-size/--set; checked once."""
    from multilane.engine.cli.train import _parse_value
    from multilane.engine.config import build_config, check_task_file, is_task_file, merge, read_config_file

    base = read_config_file(args.config) if args.config else {}
    section = base.get("task")
    if isinstance(section, dict) and section.get("name") not in (None, task):
        section["params"] = {}  # another task's params would not fit this task's schema
    o: dict[str, Any] = {"task.name": task}
    if args.steps is not None:
        o["train.steps"] = args.steps
    if args.epochs is not None:
        o["train.epochs"], o["train.steps"] = args.epochs, None
    if args.batch_size is not None:
        o["data.batch_size"] = args.batch_size
    for item in args.set:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--set {item!r}: expected KEY=VALUE, e.g. train.log_every=5")
        o[key.strip()] = _parse_value(raw.strip(), key.strip())
    merged = merge(base, o)
    config = build_config(merged, args.config or "sweep config")
    if is_task_file(config.task.name):
        check_task_file(config.task.name)
    return merged


def build_spec(args: argparse.Namespace) -> Any:
    from multilane.engine.sweep.space import parse_params
    from multilane.engine.sweep.spec import SweepSpec, parse_objective

    if not args.param:
        raise UserError("sweep: give at least one --param KEY=SPEC to search, e.g. --param optim.lr=log:1e-4:1e-1")
    name = args.name or "sweep"
    if not name.replace("-", "").replace("_", "").replace(".", "").isalnum() or len(name) > 80:
        raise UserError(f"--name {name[:40]!r}: use letters, digits, '.', '_' and '-' (at most 80)")
    task = args.task or "digits"
    base = _base_config(args, task)
    objective, direction = parse_objective(args.objective or "val_loss:min")
    spec = SweepSpec(
        task=task,
        params=parse_params(args.param, task),
        trials=args.trials or DEFAULT_TRIALS,
        base=base,
        per_trial=args.per_trial or 1,
        objective=objective,
        direction=direction,
        sampler=args.sampler or "tpe",
        pruner=args.pruner or "median",
        seed=args.seed,
        name=name,
        trial_timeout=args.trial_timeout,
    )
    if spec.sampler == "grid":
        size = math.prod(len(p.grid()) for p in spec.params)
        if spec.trials > size:
            print(f"multilane: note: the grid holds {size} combinations; --trials {spec.trials} becomes {size}")
            spec.trials = size
    return spec


def cmd_sweep(args: argparse.Namespace) -> int:
    from multilane.engine.sweep.slots import split_slots
    from multilane.engine.sweep.study import Sweep

    args.storage = _storage(args)
    if args.resume:
        given = [f for f in ("task", "param", "config", "storage", "name", "sampler", "seed", "objective")
                 if getattr(args, f)]  # fmt: skip
        if given:
            raise UserError(f"--resume takes the sweep's own settings; --{given[0]} cannot change them")
        sweep = Sweep.open(args.resume)
        target = args.trials or sweep.spec.trials
        if args.pruner:  # how unfinished trials are judged may change; what was searched may not
            from multilane.engine.sweep.sampling import make_pruner

            sweep.spec.pruner = args.pruner
            sweep.study.pruner = make_pruner(sweep.spec)
        if args.trial_timeout:  # how long a trial may run may change too
            sweep.spec.trial_timeout = args.trial_timeout
    else:
        spec = build_spec(args)
        split_slots(args.devices or "auto", spec.per_trial)  # bad devices: one line before the folder exists
        sweep = Sweep.create(spec, args.sweeps_dir or "sweeps", args.storage)
        target = spec.trials
    slots = split_slots(args.devices or "auto", args.per_trial or sweep.spec.per_trial)
    print(f"sweep {sweep.folder} · {target} trials · {len(slots)} slot(s): {' | '.join(slots)}", flush=True)
    return _run(sweep, slots, target, args.no_table)


def cmd_sweep_worker(args: argparse.Namespace) -> int:
    from pathlib import Path

    from multilane.engine.sweep.slots import split_slots
    from multilane.engine.sweep.study import Sweep

    if args.host or args.stop:
        from multilane.engine.cli.sweep_host import cmd_sweep_worker_host

        return cmd_sweep_worker_host(args)
    if args.detach:
        raise UserError("sweep-worker --detach starts a worker on a host: name it with --host HOST")
    storage = _storage(args)
    if not storage:
        raise UserError("sweep-worker: give --storage URL (the study's RDB storage) and --study NAME")
    if not args.study:
        raise UserError("sweep-worker: give --study NAME (the sweep's --name)")
    folder = Path(args.sweeps_dir or "sweeps") / args.study
    say = lambda line: print(f"sweep-worker: {line}", flush=True)  # noqa: E731
    sweep = Sweep.join(storage, args.study, folder, wait_s=args.wait, say=say)
    slots = split_slots(args.devices or "auto", args.per_trial or sweep.spec.per_trial)
    print(f"sweep-worker {args.study} · trial folders in {folder} · {len(slots)} slot(s): {' | '.join(slots)}")
    return _run(sweep, slots, sweep.spec.trials, args.no_table, args.worker_name)


def _storage(args: argparse.Namespace) -> str | None:
    """--storage; ``-`` reads the URL from standard input, so that its password is on no command line
    (how the app and ``sweep-worker --host`` pass it)."""
    if args.storage != "-":
        return args.storage or None
    url = sys.stdin.readline().strip()
    if not url:
        raise UserError("--storage -: no URL on standard input")
    return url


def _run(sweep: Any, slots: list[str], target: int, no_table: bool, worker: str | None = None) -> int:
    from multilane.engine.sweep.rows import trial_rows
    from multilane.engine.sweep.runner import SweepRunner
    from rich.console import Console
    from rich.live import Live

    runner = SweepRunner(sweep, slots, target, worker=worker)
    console = Console()
    if not console.is_terminal:  # a pipe or a log file: the whole table, not 80 columns of ellipses
        console = Console(width=200)
    _stop_on_signals(runner, console)
    lost = sweep.recover_lost()
    if lost:
        print(f"trials {', '.join(map(str, lost))} had lost their process: recorded failed, their params re-queued")
    runner.start()
    seen: dict[int, str] = {}
    if console.is_terminal and not no_table:
        with Live(console=console, refresh_per_second=4) as live:
            while runner.running():
                live.update(_table(sweep, runner))
                runner.wait(REFRESH_S)
            live.update(_table(sweep, runner))
    else:
        while runner.running():
            runner.wait(REFRESH_S)
            _print_finished(sweep, seen)
        _print_finished(sweep, seen)
        console.print(_table(sweep, runner))
    for e in dict.fromkeys(runner.errors):
        print(f"multilane: error: {e}", file=sys.stderr)
    rows = trial_rows(sweep.study)
    best = next((r for r in rows if r["is_best"]), None)
    if best is not None:
        params = ", ".join(f"{k}={_fmt(v)}" for k, v in best["params"].items())
        print(f"best trial {best['number']}: {sweep.spec.objective} {best['value']:.6g} · {params}")
        print(f"  run folder: {_fmt(best['run_dir'])}")
    c = sweep.counts()
    print(f"{c['done']} of {target} trials done · sweep folder: {sweep.folder}")
    if runner.errors:
        return 1 if not any("objective" in e for e in runner.errors) else 2
    return 130 if runner.stopping and c["done"] < target else 0


def _table(sweep: Any, runner: Any) -> Any:
    from multilane.engine.sweep.rows import trial_rows
    from rich.markup import escape
    from rich.table import Table

    steps = {n: live.process.step for n, live in list(runner.live.items())}
    rows = trial_rows(sweep.study, steps)
    keys = [p.key for p in sweep.spec.params]
    t = Table(title=f"{sweep.spec.name}: {sweep.spec.objective} ({sweep.spec.direction})", expand=False)
    hosts = ("host",) if sweep.storage_url else ()  # a shared study: workers on several machines
    for col in ("#", "state", *keys, sweep.spec.objective, "best so far", "step", "time", "devices", *hosts):
        t.add_column(col, justify="right" if col not in ("state", "devices", "host") else "left")
    colours = {"complete": "green", "pruned": "yellow", "failed": "red", "lost": "magenta", "running": "cyan"}
    for r in rows:
        mark = " ★" if r["is_best"] else ""
        t.add_row(
            f"{r['number']}{mark}",
            f"[{colours.get(r['state'], 'white')}]{r['state']}[/]",
            *(escape(_fmt(r["params"].get(k))) for k in keys),
            _fmt(r["value"]),
            _fmt(r["best"]),
            "" if r["step"] is None else str(r["step"]),
            "" if r["duration_s"] is None else f"{r['duration_s']:.0f} s",
            escape(_fmt(r["devices"])),
            *([escape(_fmt(r["host"]))] if hosts else []),
        )
    return t


def _print_finished(sweep: Any, seen: dict[int, str]) -> None:
    from multilane.engine.sweep.rows import trial_rows

    for r in trial_rows(sweep.study):
        if r["state"] != "running" and seen.get(r["number"]) != r["state"] and r["state"] != "waiting":
            seen[r["number"]] = r["state"]
            params = ", ".join(f"{k}={_fmt(v)}" for k, v in r["params"].items())
            extra = f" ({printable(str(r['error']))})" if r["error"] else ""
            print(f"trial {r['number']} {r['state']}: {_fmt(r['value'])} · {params}{extra}", flush=True)


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}"
    return printable(str(v))  # a trial's params and errors come from the study's storage: shown, not obeyed


def _stop_on_signals(runner: Any, console: Any) -> None:
    """Ctrl+C or SIGTERM: the first stops the sweep (running trials stop with a checkpoint and are
    re-queued for --resume); the second exits at once (the trials get SIGTERM from the kernel, and their
    whole trees SIGKILL from their guards a few seconds later)."""
    count = 0

    def on_signal(signum: int, frame: Any) -> None:
        nonlocal count
        count += 1
        if count == 1:
            console.print("[yellow]stopping the sweep: running trials stop and are re-queued (Ctrl+C again to quit)[/]")
            runner.stop()
        else:  # each trial gets its parent-death SIGTERM; its guard SIGKILLs its whole tree a moment later
            import os

            runner.hurry()
            os._exit(130)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    answer_missed_ctrl_c(on_signal)
