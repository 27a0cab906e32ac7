"""The ``multilane`` command: ``train``, ``watch``, ``control``, ``devices``, ``export``; with no arguments,
the desktop app."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from typing import Any, NoReturn

from multilane.engine.callbacks import TrainerCallback
from multilane.engine.errors import UserError


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # No prefixes: `--epoch 3` must not silently become `--epochs 3`.
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        # One line, exit 2: what is wrong (and the option meant, for a typo), not a usage screen.
        self.exit(2, f"{self.prog}: error: {message}{_suggestion(self, message)} (see --help)\n")


class _HelpFormatter(argparse.HelpFormatter):
    """Each option's help ends with its default, where it has one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" not in text and action.default not in (None, False, [], argparse.SUPPRESS):
            text += " (default: %(default)s)"
        return text


def _suggestion(parser: argparse.ArgumentParser, message: str) -> str:
    """ "; did you mean --epochs?" for an unknown option close to a known one."""
    if "unrecognized arguments:" not in message:
        return ""
    import difflib

    known: list[str] = []
    for action in parser._actions:
        known += action.option_strings
        for sub in (action.choices or {}).values() if isinstance(action, argparse._SubParsersAction) else ():
            for a in sub._actions:
                known += a.option_strings
    for word in message.split(":", 1)[1].split():
        flag = word.split("=", 1)[0]
        if flag.startswith("--"):
            close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
            if close:
                return f"; did you mean {close[0]}?"
    return ""


MAX_WHOLE = 10**12  # no count of steps, epochs or pixels is larger; int() of 5,000 digits is refused
MIN_WIDTH, MAX_WIDTH = 200, 10_000  # the app's PNG width dialog takes the same range


def _short_text(text: str) -> str:
    return repr(text) if len(text) <= 24 else repr(text[:20] + "...")


def _whole(text: str, low: int = 0, high: int = MAX_WHOLE) -> int:
    digits = text.strip().lstrip("+-")
    if digits.isdigit() and len(digits) > 15:
        raise argparse.ArgumentTypeError(f"{_short_text(text)} is too large (at most {high:,})")
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{_short_text(text)} is not a whole number") from None
    if v < low:
        raise argparse.ArgumentTypeError(f"{v} must be at least {low}")
    if v > high:
        raise argparse.ArgumentTypeError(f"{v} is too large (at most {high:,})")
    return v


def _positive_int(text: str) -> int:
    return _whole(text, 1)


def _seed(text: str) -> int:
    return _whole(text, 0, 2**32 - 1)


def _width(text: str) -> int:
    return _whole(text, MIN_WIDTH, MAX_WIDTH)


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{_short_text(text)} is not a number") from None


def build_parser() -> argparse.ArgumentParser:
    from multilane.engine import __version__
    from multilane.engine.config import RunConfig

    d0 = RunConfig()  # the defaults the help shows are the config's own
    p = _Parser(prog="multilane", description="Data-parallel PyTorch training across the GPUs of one machine.")
    p.add_argument("--version", action="version", version=f"multilane {__version__}")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)

    t = sub.add_parser("train", help="train headless, with a progress bar", description="Train headless.")
    t.add_argument("--config", metavar="FILE", help="TOML or JSON config; flags below override it")
    t.add_argument(
        "--task",
        metavar="NAME|FILE",
        help=f"digits, linear, mlp, charlm, imagefolder, or a .py file defining a Task (default: {d0.task.name})",
    )
    t.add_argument(
        "--devices",
        metavar="LIST",
        help=f"cuda:0,cuda:1 | cpu:0,cpu:1 | auto: every GPU, else two CPU lanes (default: {d0.devices.use})",
    )
    t.add_argument(
        "--batch-size",
        type=_positive_int,
        metavar="N",
        help=f"global batch, split across the devices (default: {d0.data.batch_size})",
    )
    t.add_argument("--lr", type=_number, metavar="X", help=f"learning rate (default: {d0.optim.lr:g})")
    t.add_argument("--optimizer", metavar="NAME", help=f"sgd, adam or adamw (default: {d0.optim.name})")
    budget = t.add_mutually_exclusive_group()
    budget.add_argument(
        "--epochs", type=_positive_int, metavar="N", help=f"passes over the training data (default: {d0.train.epochs})"
    )
    budget.add_argument("--steps", type=_positive_int, metavar="N", help="optimizer steps, instead of --epochs")
    t.add_argument(
        "--seed", type=_seed, metavar="N", help=f"seed of data order and initial weights (default: {d0.train.seed})"
    )
    t.add_argument("--precision", metavar="P", help=f"fp32, bf16 or fp16 (default: {d0.train.precision})")
    t.add_argument("--runs-dir", metavar="DIR", help=f"where run folders go (default: ./{d0.run.runs_dir})")
    t.add_argument("--name", metavar="NAME", help=f"run name, part of the run folder's name (default: {d0.run.name})")
    t.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last checkpoint")
    t.add_argument(
        "--strategy",
        metavar="S",
        help="replicate (default: one process, the model copied to every device each step, as nn.DataParallel), "
        "persistent (one process, a replica kept per device), or ddp (one process per device)",
    )
    dd = t.add_argument_group("ddp launch (multi-node; or run under torchrun --no-python multilane train ...)")
    dd.add_argument("--nnodes", type=_positive_int, default=1, metavar="N", help="machines taking part (default 1)")
    dd.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="the rendezvous (default: a free local port)")
    dd.add_argument("--rdzv-id", metavar="ID", help="run id, the same on every node (default: multilane)")
    dd.add_argument(
        "--rdzv-timeout", type=_number, default=60.0, metavar="S", help="seconds to wait for every node (default 60)"
    )
    t.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any config value, e.g. --set train.log_every=5 --set task.params.hidden=128",
    )

    e = sub.add_parser(
        "export",
        help="export a run's figures and metrics (no display, no Qt needed)",
        description="Write loss.* (every device, combined, validation), plots.* (every plot), compare.* "
        "(with --compare: one curve per run) as PNG, SVG and PDF with real text, and metrics.csv.",
    )
    e.add_argument("run_dir", metavar="RUN_DIR")
    e.add_argument("--out", required=True, metavar="DIR", help="folder to write into")
    e.add_argument("--format", default="png,svg,pdf,csv", metavar="LIST", help="any of png,svg,pdf,csv")
    e.add_argument("--width", type=_width, default=1600, metavar="PX", help="PNG width in pixels")
    e.add_argument("--compare", action="append", default=[], metavar="RUN_DIR", help="another run to compare with")
    e.add_argument("--smoothing", type=_number, default=0.0, metavar="A", help="EMA of the train loss, 0 to 0.99")
    e.add_argument("--x", choices=["step", "time"], default="step", help="x axis: optimizer step or elapsed time")
    e.add_argument("--log-y", action="store_true", help="logarithmic loss axis")

    w = sub.add_parser("watch", help="follow a run another process is writing: its live progress line")
    w.add_argument("run_dir", metavar="RUN_DIR")
    w.add_argument("--interval", type=_number, default=0.5, metavar="S", help="seconds between refreshes")

    c = sub.add_parser("control", help="pause, resume or stop a run (also on another machine) via its run folder")
    c.add_argument("run_dir", metavar="RUN_DIR")
    c.add_argument("action", choices=["pause", "resume", "stop"], metavar="pause|resume|stop")

    d = sub.add_parser("devices", help="list the devices this machine offers, with live utilization and memory")
    d.add_argument("--json", action="store_true", help="print JSON")
    d.add_argument("--watch", action="store_true", help="refresh every second until Ctrl+C")
    return p


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    o: dict[str, Any] = {}
    flags = {
        "task": "task.name",
        "devices": "devices.use",
        "strategy": "devices.strategy",
        "batch_size": "data.batch_size",
        "lr": "optim.lr",
        "optimizer": "optim.name",
        "epochs": "train.epochs",
        "steps": "train.steps",
        "seed": "train.seed",
        "precision": "train.precision",
        "runs_dir": "run.runs_dir",
        "name": "run.name",
    }
    for attr, key in flags.items():
        value = getattr(args, attr)
        if value is not None:
            o[key] = value
    if args.epochs is not None:
        o["train.steps"] = None  # --epochs wins over a config file's steps
    if args.task is not None and args.task:
        o.setdefault("task.params", {})
    for item in args.set:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UserError(f"--set {_short_text(item)}: expected KEY=VALUE, e.g. train.log_every=5")
        if not all(part.strip() for part in key.split(".")):
            raise UserError(f"--set {_short_text(item)}: {key!r} is not a key; keys are names joined by dots")
        o[key] = _parse_value(raw.strip(), key)
    return o


def _parse_value(raw: str, key: str) -> Any:
    """JSON where it parses (numbers, lists, true/false), else the text itself."""
    if len(raw) > 100_000:
        raise UserError(f"--set {key}: the value is {len(raw):,} characters long; give it in a --config file")
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw
    except RecursionError:
        raise UserError(f"--set {key}: the value is nested too deeply") from None
    except ValueError as e:  # a number of thousands of digits
        raise UserError(f"--set {key}: {str(e).split(';')[0]}") from None


def _run_config(args: argparse.Namespace, overrides: dict[str, Any]) -> Any:
    """The run's config: the file and flags, or (resuming) the checkpoint's config and the flags."""
    from multilane.engine.config import build_config, merge, read_config_file

    if args.resume:
        from multilane.engine.runlog import RunDir

        base = RunDir.open_existing(args.resume, lock=False).load_checkpoint().get("config")
        if not isinstance(base, dict):
            raise UserError(f"resume: {args.resume}: the checkpoint holds no config")
        return build_config(merge(base, overrides), "resume config")
    base = read_config_file(args.config) if args.config else {}
    section = base.get("task")
    if args.task is not None and isinstance(section, dict) and section.get("name") not in (None, args.task):
        # Another task's params would not fit this task's schema.
        section["params"] = {}
    return build_config(merge(base, overrides), args.config or "config")


def cmd_train(args: argparse.Namespace, argv: list[str]) -> int:
    from multilane.engine.distributed import in_worker

    overrides = _overrides(args)
    if args.task is not None and "task.params" in overrides and overrides["task.params"] == {}:
        del overrides["task.params"]
    config = _run_config(args, overrides)  # checked before torch is imported, where it can be
    if config.devices.strategy == "ddp":
        if in_worker():
            from multilane.engine.distributed.worker import run_rank

            return run_rank(None if args.resume else config, args.resume, overrides)
        from multilane.engine.distributed.launcher import launch
        from multilane.engine.tasks import make_task

        make_task(config.task.name, config.task.params)  # a bad task is one line here, not one per rank
        return launch(argv, config, args.resume, args.nnodes, args.rdzv_endpoint, args.rdzv_timeout, args.rdzv_id)
    if in_worker():
        raise UserError("started by torchrun: add --strategy ddp (each process is one rank of a ddp run)")
    from rich.console import Console

    # On a terminal, a spinner until the first step (imports, data and model take seconds); it goes
    # away when the progress bar starts or an error is printed, so an error stays one line.
    console = Console(stderr=True)
    waiting = console.status("loading torch, data and model…") if console.is_terminal else None
    if waiting is not None:
        waiting.start()
    try:
        from multilane.engine.control import RunControl
        from multilane.engine.distributed.worker import RUN_DIR_ENV
        from multilane.engine.progress import ProgressDisplay, summary
        from multilane.engine.trainer import Trainer

        control = RunControl()
        progress = ProgressDisplay(console, waiting=waiting)
        _stop_on_signals(control, progress.console)  # from the start: set-up (the task's import, data) too
        callbacks = [progress, _NameTaskFile()]
        if args.resume:
            trainer = Trainer(callbacks=callbacks, control=control, resume_from=args.resume, overrides=overrides)
        else:  # the app that started this process may have made the run folder, to follow it
            trainer = Trainer(config, callbacks=callbacks, control=control, run_dir=os.environ.get(RUN_DIR_ENV))
    except BaseException:
        if waiting is not None:
            waiting.stop()
        raise
    try:
        result = trainer.run()
    finally:
        progress.stop_waiting()
    _exit_on_signals()  # the outcome is recorded: a Ctrl+C from here on ends the process at once
    print(summary(result, getattr(trainer, "total_steps", None), progress.timing()))
    if result.status == "failed":
        if result.traceback:
            print(f"  traceback: {result.run_dir / 'error.txt'}", file=sys.stderr)
        return 1
    if result.status == "aborted":
        return 130
    if result.status == "stopped" and not control.stop_requested:
        return 1  # stopped by the engine itself (a non-finite loss)
    return 0


class _NameTaskFile(TrainerCallback):
    """Says which file is about to run, before it is imported."""

    def on_task_file(self, path: str) -> None:
        print(f"running task file {path}", flush=True)


def _exit_on_signals() -> None:
    def on_signal(signum: int, frame: Any) -> None:
        os._exit(130)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)


def _stop_on_signals(control: Any, console: Any) -> None:
    """Ctrl+C or SIGTERM: the first finishes the step (or the set-up) and stops with a checkpoint; the
    second aborts (KeyboardInterrupt, recorded as "aborted"); a third exits at once."""
    count = 0

    def on_signal(signum: int, frame: Any) -> None:
        nonlocal count
        count += 1
        if count == 1:
            console.print("[yellow]stopping after this step (press Ctrl+C again to abort)[/]")
            control.request_stop()
        elif count == 2:
            raise KeyboardInterrupt
        else:
            os._exit(130)  # the abort itself is stuck: leave now, as a kill would

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)


def cmd_watch(args: argparse.Namespace) -> int:
    from multilane.engine.watch import watch

    return watch(args.run_dir, args.interval)


def cmd_control(args: argparse.Namespace) -> int:
    from multilane.engine.control_file import write_control

    path = write_control(args.run_dir, args.action)
    print(f"{args.action} requested: {path}")
    return 0


def cmd_devices(args: argparse.Namespace) -> int:
    from multilane.engine.telemetry import live_readings

    if args.json:
        print(json.dumps(live_readings(), indent=2))
        return 0
    if not args.watch:
        from rich.console import Console

        Console().print(devices_table(live_readings()))
        return 0
    from rich.live import Live

    with Live(devices_table(live_readings()), auto_refresh=False) as live:
        try:
            while True:
                live.update(devices_table(live_readings(1.0)), refresh=True)
        except KeyboardInterrupt:
            pass
    return 0


def devices_table(rows: list[dict]) -> Any:
    from rich.table import Table

    table = Table(box=None, header_style="bold")
    for col in ("device", "model", "util", "memory used / total", "temp", "power"):
        table.add_column(col)
    for r in rows:
        util = f"{r['util_pct']:.0f}%" if r.get("util_pct") is not None else "-"
        used, total = r.get("mem_used_mb"), r.get("memory_total_mb")
        memory = f"{used / 1024:,.1f} / {total / 1024:,.1f} GiB" if used is not None and total else "-"
        temp = f"{r['temp_c']:.0f} °C" if "temp_c" in r else "-"
        power = f"{r['power_w']:.0f} W" if "power_w" in r else "-"
        name = r["name"] if r["kind"] == "cuda" else f"cpu ×{r['cores']}"
        table.add_row(name, str(r.get("model", "")), util, memory, temp, power)
    return table


def cmd_export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from multilane.engine.runlog import load_metrics
    from multilane.gui.export import FORMATS, export_headless

    formats = [f.strip().lower() for f in args.format.split(",") if f.strip()]
    bad = [f for f in formats if f not in FORMATS]
    if bad or not formats:
        raise UserError(f"export: unknown format {bad[0] if bad else '(none)'!r}; use {', '.join(FORMATS)}")
    if not 0 <= args.smoothing < 1:
        raise UserError(f"export: --smoothing {args.smoothing:g} is outside 0 to 0.99")
    run, out = Path(args.run_dir), Path(args.out)
    try:
        if not (run / "metrics.jsonl").exists():
            raise UserError(f"export: {run} is not a run folder (no metrics.jsonl)")
        if out.exists() and out.resolve() == run.resolve():
            raise UserError(f"export: --out {out} is the run folder itself; export into another folder")
    except ValueError as e:  # an embedded NUL
        raise UserError(f"export: not a usable path ({e})") from None
    note = load_metrics(run).skipped_note()  # a folder or unreadable file is one line here
    if note:
        print(f"multilane: warning: {run / 'metrics.jsonl'}: {note}", file=sys.stderr)
    options = {"compare": args.compare, "smoothing": args.smoothing, "x_mode": args.x, "log_y": args.log_y}
    for path in export_headless(args.run_dir, args.out, formats, args.width, **options):
        print(path)
    return 0


def cmd_app() -> int:
    from multilane.gui.platform_check import window_problem

    problem = window_problem()  # before Qt, which would abort with a message naming one library
    if problem:
        raise UserError(problem)
    try:
        from multilane.gui.app import main as app_main
    except ImportError as e:
        raise UserError(
            f"the desktop app needs PySide6 and pyqtgraph ({e.name or e} missing): pip install 'multilane[gui]'; "
            "or train headless with: multilane train"
        ) from None
    return app_main()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    try:
        if args.command == "train":
            return cmd_train(args, argv[argv.index("train") + 1 :])
        if args.command == "watch":
            return cmd_watch(args)
        if args.command == "control":
            return cmd_control(args)
        if args.command == "devices":
            return cmd_devices(args)
        if args.command == "export":
            return cmd_export(args)
        return cmd_app()
    except UserError as e:
        print(f"multilane: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before a run began (its set-up, the task's import): nothing to record
        print("multilane: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
