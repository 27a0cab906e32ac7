"""The ``multilane`` command: ``train``, ``plan``, ``watch``, ``control``, ``devices``, ``export``, ``sweep``; with no arguments,
the desktop app. This module dispatches; each command lives in its own module (train, monitor),
except ``export`` and the app, the two that reach into ``multilane.gui`` (lazily, inside the function)."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

from multilane.engine.cli.monitor import cmd_control, cmd_devices, cmd_watch
from multilane.engine.cli.parser import build_parser
from multilane.engine.cli.train import cmd_train
from multilane.engine.errors import UserError


def cmd_export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from multilane.engine.rundir.runlog import load_metrics
    from multilane.engine.rundir.runs_folder import run_folder_problem
    from multilane.gui.plots.export import FORMATS, export_headless

    formats = [f.strip().lower() for f in args.format.split(",") if f.strip()]
    bad = [f for f in formats if f not in FORMATS]
    if bad or not formats:
        raise UserError(f"export: unknown format {bad[0] if bad else '(none)'!r}; use {', '.join(FORMATS)}")
    if not 0 <= args.smoothing < 1:
        raise UserError(f"export: --smoothing {args.smoothing:g} is outside 0 to 0.99")
    run, out = Path(args.run_dir), Path(args.out)
    try:
        problem = run_folder_problem(run)
        if problem:
            raise UserError(f"export: {problem}")
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
    from multilane.gui.window.platform_check import window_problem

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


def _remote(args: argparse.Namespace) -> int | None:
    """A command aimed at a host over SSH (``--host``, ``watch HOST:RUN_DIR``), or None for a local one."""
    from pathlib import Path

    if args.command == "watch":
        from multilane.engine.remote.hosts import split_remote_path

        where = None if Path(args.run_dir).expanduser().exists() else split_remote_path(args.run_dir)
        if where is None:
            return None
        from multilane.engine.cli.remote import cmd_remote_watch

        return cmd_remote_watch(args, *where)
    if not getattr(args, "host", None):
        return None
    from multilane.engine.cli import remote

    if args.command == "train":  # --host repeats: one host, or one ddp run across several
        from multilane.engine.cli.multi_host import cmd_train_hosts

        return cmd_train_hosts(args)
    return remote.cmd_remote_devices(args)


# Ctrl+C while torch loads: held until its import ends, then delivered as usual. A KeyboardInterrupt
# raised while torch's C++ extension initialises goes wrong in every way: of 32 presses during
# `multilane train`'s start, 4 were swallowed (the run trained to its end), 1 aborted the process
# (SIGABRT: "terminate called after throwing an instance of 'pybind11::error_already_set'"), 1 was a
# numpy ImportError traceback and 1 a false "setup failed: RecursionError" (tests/engine/cli/
# test_ctrl_c_during_start.py). So the command's first act installs this finder: wherever torch is first
# imported (a command, a task file, a ddp rank), SIGINT only sets a flag until the import is done, then
# is raised again for the handler in place by then (the default one: "multilane: interrupted", 130).
class _HoldWhileTorchLoads:  # a meta path finder (importlib.abc's base class costs an import)
    """Finds nothing itself: asks the finders after it for ``torch``, and holds SIGINT around its load."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname != "torch":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)  # once: torch loads once per process
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            spec: ModuleSpec | None = find(fullname, path, target) if find else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    _hold_during(spec.loader)
                return spec
        return None


def _hold_during(loader: Any) -> None:
    run = loader.exec_module

    def exec_module(module: ModuleType) -> None:
        del loader.exec_module  # the loader as it was, for any later use
        if threading.current_thread() is not threading.main_thread():
            return run(module)
        pressed: list[int] = []
        previous = signal.signal(signal.SIGINT, lambda signum, _frame: pressed.append(signum))
        try:
            run(module)
        finally:
            signal.signal(signal.SIGINT, previous)
            if pressed:
                signal.raise_signal(signal.SIGINT)  # to the handler in place now, as if pressed just now

    loader.exec_module = exec_module


def hold_ctrl_c_while_torch_loads() -> None:
    """Install the hold for this process's first ``import torch`` (nothing if torch is loaded already)."""
    if "torch" not in sys.modules and not any(isinstance(f, _HoldWhileTorchLoads) for f in sys.meta_path):
        sys.meta_path.insert(0, _HoldWhileTorchLoads())


MAX_LINE = 1000


def one_line(message: str, limit: int = MAX_LINE) -> str:
    """An error line of readable length: a value the user gave (a 500,000-character path) is cut in
    the middle, so the line keeps its start (what is wrong) and its end (the rule)."""
    if len(message) <= limit:
        return message
    keep = (limit - 40) // 2
    return f"{message[:keep]}…[{len(message) - 2 * keep:,} characters cut]…{message[-keep:]}"


def main(argv: list[str] | None = None) -> int:
    hold_ctrl_c_while_torch_loads()  # a Ctrl+C during torch's import is held, not swallowed or an abort
    try:
        return _main(argv)
    except KeyboardInterrupt:  # before a run began (parsing, its set-up, the task's import): nothing to record
        print("multilane: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    try:
        if args.command in ("train", "devices", "watch"):
            remote = _remote(args)
            if remote is not None:
                return remote
        if args.command == "plan" or (args.command == "train" and args.dry_run):
            from multilane.engine.cli.plan import cmd_plan

            return cmd_plan(args)
        if args.command == "train":
            return cmd_train(args, argv[argv.index("train") + 1 :])
        if args.command == "watch":
            return cmd_watch(args)
        if args.command == "control":
            return cmd_control(args)
        if args.command == "devices":
            return cmd_devices(args)
        if args.command in ("sweep", "sweep-worker"):
            from multilane.engine.cli.sweep import cmd_sweep, cmd_sweep_worker

            return cmd_sweep(args) if args.command == "sweep" else cmd_sweep_worker(args)
        if args.command == "export":
            return cmd_export(args)
        return cmd_app()
    except UserError as e:
        print(f"multilane: error: {one_line(str(e))}", file=sys.stderr)
        return 2
