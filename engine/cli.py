"""The ``multilane`` command: ``train``, ``devices``, ``export``; with no arguments, the desktop app."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from typing import Any, NoReturn

from multilane.engine.errors import UserError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line, exit 2: what is wrong, not a usage screen.
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v} must be at least 1")
    return v


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="multilane", description="Data-parallel PyTorch training across the GPUs of one machine.")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)

    t = sub.add_parser("train", help="train headless, with a progress bar", description="Train headless.")
    t.add_argument("--config", metavar="FILE", help="TOML or JSON config; flags below override it")
    t.add_argument(
        "--task", metavar="NAME|FILE", help="digits, linear, mlp, charlm, imagefolder, or a .py file defining a Task"
    )
    t.add_argument("--devices", metavar="LIST", help="cuda:0,cuda:1 | cpu:0,cpu:1 | auto")
    t.add_argument("--strategy", metavar="NAME", help="replicate or persistent (devices.strategy)")
    t.add_argument("--batch-size", type=_positive_int, metavar="N")
    t.add_argument("--lr", type=_number, metavar="X")
    t.add_argument("--optimizer", metavar="NAME", help="sgd, adam or adamw")
    budget = t.add_mutually_exclusive_group()
    budget.add_argument("--epochs", type=_positive_int, metavar="N")
    budget.add_argument("--steps", type=_positive_int, metavar="N")
    t.add_argument("--seed", type=int, metavar="N")
    t.add_argument("--precision", metavar="P", help="fp32, bf16 or fp16")
    t.add_argument("--runs-dir", metavar="DIR", help="where run folders go (default: ./runs)")
    t.add_argument("--name", metavar="NAME", help="run name, part of the run folder's name")
    t.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last checkpoint")
    t.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any config value, e.g. --set train.log_every=5 --set task.params.hidden=128",
    )

    e = sub.add_parser("export", help="export a run's plots and metrics (no display needed)")
    e.add_argument("run_dir", metavar="RUN_DIR")
    e.add_argument("--out", required=True, metavar="DIR", help="folder to write into")
    e.add_argument("--format", default="png,svg,csv", metavar="LIST", help="any of png,svg,csv (default: all)")
    e.add_argument("--width", type=_positive_int, default=1600, metavar="PX", help="PNG width in pixels")

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
        if not sep or not key.strip():
            raise UserError(f"--set {item!r}: expected KEY=VALUE, e.g. train.log_every=5")
        o[key.strip()] = _parse_value(raw.strip())
    return o


def _parse_value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def cmd_train(args: argparse.Namespace) -> int:
    from multilane.engine.config import build_config, merge, read_config_file
    from multilane.engine.control import RunControl
    from multilane.engine.progress import ProgressDisplay, summary
    from multilane.engine.trainer import Trainer

    overrides = _overrides(args)
    if args.task is not None and "task.params" in overrides and overrides["task.params"] == {}:
        del overrides["task.params"]
    control = RunControl()
    progress = ProgressDisplay()
    if args.resume:
        trainer = Trainer(callbacks=[progress], control=control, resume_from=args.resume, overrides=overrides)
    else:
        base = read_config_file(args.config) if args.config else {}
        if args.task is not None and base.get("task", {}).get("name") not in (None, args.task):
            # Another task's params would not fit this task's schema.
            base.setdefault("task", {})["params"] = {}
        config = build_config(merge(base, overrides), args.config or "config")
        trainer = Trainer(config, callbacks=[progress], control=control)

    def on_signal(signum: int, frame: Any) -> None:
        progress.console.print("[yellow]stopping after this step (press Ctrl+C again to abort)[/]")
        control.request_stop()
        signal.signal(signal.SIGINT, signal.default_int_handler)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    result = trainer.run()
    print(summary(result, getattr(trainer, "total_steps", None)))
    if result.status == "failed":
        print(f"  traceback: {result.run_dir / 'error.txt'}", file=sys.stderr)
        return 1
    if result.status == "stopped" and not control.stop_requested:
        return 1  # stopped by the engine itself (a non-finite loss)
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
    formats = [f.strip().lower() for f in args.format.split(",") if f.strip()]
    bad = [f for f in formats if f not in ("png", "svg", "csv")]
    if bad or not formats:
        raise UserError(f"export: unknown format {bad[0] if bad else '(none)'!r}; use png, svg, csv")
    try:
        from multilane.gui.export import exit_without_qt_teardown, export_headless
    except ImportError as e:
        raise UserError(
            f"export needs PySide6 and pyqtgraph ({e.name or e} missing): pip install 'multilane[gui]'"
        ) from None
    for path in export_headless(args.run_dir, args.out, formats, args.width):
        print(path)
    exit_without_qt_teardown(0)
    return 0


def cmd_app() -> int:
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
    args = parser.parse_args(argv)
    try:
        if args.command == "train":
            return cmd_train(args)
        if args.command == "devices":
            return cmd_devices(args)
        if args.command == "export":
            return cmd_export(args)
        return cmd_app()
    except UserError as e:
        print(f"multilane: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
