"""The ``multilane`` command: ``train``, ``plan``, ``watch``, ``control``, ``devices``, ``export``, ``sweep``; with no arguments,
the desktop app. This module dispatches; each command lives in its own module (train, monitor),
except ``export`` and the app, the two that reach into ``multilane.gui`` (lazily, inside the function)."""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
from typing import Any

from multilane.engine.cli.interrupts import hold_ctrl_c_while_torch_loads, note_ctrl_c
from multilane.engine.cli.monitor import cmd_control, cmd_devices, cmd_watch
from multilane.engine.cli.parser import build_parser
from multilane.engine.cli.train import cmd_train
from multilane.engine.display.terminal_text import printable
from multilane.engine.errors import NothingToTrain, UserError


def cmd_export(args: argparse.Namespace) -> int:
    """Paths first (one line each, before the plotting code is imported), then formats, then the export."""
    from multilane.engine.rundir.readfile import user_path
    from multilane.engine.rundir.runlog import load_metrics
    from multilane.engine.rundir.runs_folder import NOT_A_RUN, run_folder_problem, says_it_is_a_run

    if not 0 <= args.smoothing < 1:
        raise UserError(f"export: --smoothing {args.smoothing:g} is outside 0 to 0.99")
    if args.out is None and args.mlflow is None and args.adapter is None and args.merged is None:
        raise UserError(
            "export: say where to: --out DIR (figures, CSV), --mlflow URI (a tracking server), "
            "--adapter DIR or --merged DIR (the model), or several"
        )
    run = user_path(args.run_dir, "export")
    out = user_path(args.out, "export: --out") if args.out is not None else None
    models = {f: user_path(getattr(args, f), f"export: --{f}") for f in ("adapter", "merged") if getattr(args, f)}
    compare = [user_path(c, "export: --compare") for c in args.compare or []]
    try:
        problem = run_folder_problem(run) or (
            None if says_it_is_a_run(run) else f"{run} is not a run folder ({NOT_A_RUN})"
        )
        if problem:
            raise UserError(f"export: {problem}")
        if out is not None and out.exists() and out.resolve() == run.resolve():
            raise UserError(f"export: --out {out} is the run folder itself; export into another folder")
        for c in compare:
            problem = run_folder_problem(c)
            if problem:
                raise UserError(f"export: --compare {problem}")
    except ValueError as e:  # an embedded NUL
        raise UserError(f"export: not a usable path ({e})") from None
    if models:
        from multilane.engine.integrations.peft_export import export_models

        for path in export_models(run, models.get("adapter"), models.get("merged")):
            print(printable(str(path)))
        if out is None and args.mlflow is None:
            return 0
    if args.mlflow is not None:
        from multilane.integrations.extras import MissingExtra

        try:
            from multilane.integrations.mlflow import export_run
        except MissingExtra as e:
            raise UserError(f"export: {e}") from None
        print(printable(export_run(run, args.mlflow)))
        if out is None:
            return 0
    from multilane.gui.plots.export import FORMATS, export_headless

    formats = [f.strip().lower() for f in args.format.split(",") if f.strip()]
    bad = [f for f in formats if f not in FORMATS]
    if bad or not formats:
        raise UserError(f"export: unknown format {bad[0] if bad else '(none)'!r}; use {', '.join(FORMATS)}")
    note = load_metrics(run).skipped_note()  # a folder or unreadable file is one line here
    if note:
        print(printable(f"multilane: warning: {run / 'metrics.jsonl'}: {note}"), file=sys.stderr)
    options = {"compare": compare, "smoothing": args.smoothing, "x_mode": args.x, "log_y": args.log_y}
    for path in export_headless(run, out, formats, args.width, **options):
        print(printable(str(path)))
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


def _local_path_exists(text: str) -> bool:
    """Whether ``text`` names something on this machine (else ``watch`` may read it as HOST:RUN_DIR); a
    path no system call takes is not here (``watch`` then says why in one line)."""
    from multilane.engine.rundir.readfile import user_path

    try:
        return user_path(text, "watch").exists()
    except (UserError, OSError, ValueError):
        return False


def _remote(args: argparse.Namespace) -> int | None:
    """A command aimed at a host over SSH (``--host``, ``watch HOST:RUN_DIR``), or None for a local one."""

    if args.command == "watch":
        from multilane.engine.remote.hosts import split_remote_path

        where = None if _local_path_exists(args.run_dir) else split_remote_path(args.run_dir)
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
    # (every C extension's start holds a press from the package's import on: cli/__init__.py)
    note_ctrl_c()  # again: a forked child (engine/start/) puts Python's own handler back before main()
    stdout = sys.stdout
    if stdout is not None:  # None: no stdout at all (a GUI launcher's child); print then prints nothing
        sys.stdout = _WatchedOutput(stdout)  # type: ignore[assignment]
    try:
        code = _main(argv)
        if sys.stdout is not None:
            sys.stdout.flush()  # here, where a failure is one line, not at exit ("Exception ignored ...")
        return code
    except KeyboardInterrupt:  # before a run began (parsing, its set-up, the task's import): nothing to record
        _say("multilane: interrupted")
        return 130
    except OutputLost as e:
        return _stdout_lost(e, stdout)
    except SystemExit:  # argparse's --help or usage error: what it printed must reach stdout too
        try:
            if sys.stdout is not None:
                sys.stdout.flush()
        except OutputLost as e:
            return _stdout_lost(e, stdout)
        raise
    except OSError as e:
        # The system refused something no check foresaw (a file system's own limit, a device error): the
        # one line names the file and the reason; whatever a run had recorded stays recorded.
        where = f"{e.filename}: " if e.filename else ""
        _say(f"multilane: error: {one_line(printable(where + (e.strerror or str(e))))}")
        return 1
    finally:
        if isinstance(sys.stdout, _WatchedOutput):
            sys.stdout = stdout


class OutputLost(OSError):
    """Standard output refused a write (a full disk, ``/dev/full``, a closed pipe)."""


class _WatchedOutput:
    """``sys.stdout`` as it was, whose failed writes raise ``OutputLost``: told apart from every other
    ``OSError`` (a print gives no file name), they end the command in one line."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as e:
            raise OutputLost(e.errno, e.strerror) from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as e:
            raise OutputLost(e.errno, e.strerror) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _say(line: str) -> None:
    """A line on stderr, unless stderr itself cannot take it (nothing else could be said then)."""
    with contextlib.suppress(OSError, ValueError):
        print(line, file=sys.stderr, flush=True)


def _stdout_lost(e: OSError, stdout: Any) -> int:
    """Exit 1 after output that could not be written: one line on stderr (none for a closed pipe, whose
    reader chose to stop: ``multilane devices --json | head -1``), and stdout pointed at /dev/null so
    that Python's own flush at exit finds somewhere to put what is left in its buffer."""
    import errno
    import os

    with contextlib.suppress(OSError, ValueError, AttributeError, io.UnsupportedOperation):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, stdout.fileno())
        os.close(null)
    if e.errno != errno.EPIPE:
        _say(f"multilane: error: cannot write to standard output ({e.strerror or e})")
    return 1


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
    except NothingToTrain as e:  # not an error: the run is done (printed where a run's outcome goes)
        print(printable(one_line(str(e))))
        return 0
    except UserError as e:
        _say(f"multilane: error: {printable(one_line(str(e)))}")  # a host's or a file's text is data
        return 2
