"""``multilane train``: the config from file, flags and ``--set``; a headless run with a progress bar."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from multilane.engine.cli.interrupts import answer_missed_ctrl_c
from multilane.engine.cli.parser import short_text
from multilane.engine.display.terminal_text import printable
from multilane.engine.errors import EXIT_DIVERGED, UserError
from multilane.engine.run.callbacks import TrainerCallback
from multilane.engine.rundir.follow import DIVERGED


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
            raise UserError(f"--set {short_text(item)}: expected KEY=VALUE, e.g. train.log_every=5")
        if not all(part.strip() for part in key.split(".")):
            raise UserError(f"--set {short_text(item)}: {key!r} is not a key; keys are names joined by dots")
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
    from multilane.engine.config import build_config, check_task_file, is_task_file, merge, read_config_file

    if args.resume:
        from multilane.engine.distributed import in_worker
        from multilane.engine.rundir.runlog import RunDir

        # Refused here, before any strategy starts a process or touches the folder, when another
        # process writes it (a rank of a ddp resume: the launcher checked; rank 0 holds the lock).
        rd = RunDir.open_existing(args.resume, lock=False, in_use_ok=in_worker())
        checkpoint = rd.load_checkpoint()
        base = checkpoint.get("config")
        if not isinstance(base, dict):
            raise UserError(f"resume: {args.resume}: the checkpoint holds no config")
        config = build_config(merge(base, overrides), "resume config")
        if not in_worker():  # the launcher said it, once
            _refuse_if_trained(args.resume, checkpoint.get("step"), config, overrides)
        return config
    base = read_config_file(args.config) if args.config else {}
    section = base.get("task")
    if args.task is not None and isinstance(section, dict) and section.get("name") not in (None, args.task):
        # Another task's params would not fit this task's schema.
        section["params"] = {}
    config = build_config(merge(base, overrides), args.config or "config")
    if is_task_file(config.task.name):
        check_task_file(config.task.name)
    return config


def _refuse_if_trained(run: str, step: Any, config: Any, overrides: dict[str, Any]) -> None:
    """NothingToTrain, before any process starts or the folder is touched, where the checkpoint already
    holds the whole budget: a budget in steps is known here; one in epochs where the run says it finished
    (other epoch budgets are checked by the trainer once the data is loaded)."""
    from multilane.engine.errors import nothing_to_train
    from multilane.engine.rundir.runread import STATUS, read_json

    folder = Path(run).expanduser()
    total = config.train.steps
    if total is None and "train.epochs" not in overrides:
        status = read_json(folder / STATUS) or {}
        if status.get("state") == "finished" and status.get("step") == step:
            total = status.get("total_steps")
    if isinstance(step, int) and isinstance(total, int) and step >= total:
        raise nothing_to_train(run, step, total)


@contextlib.contextmanager
def _warnings_shown_folder() -> Iterator[None]:
    """While inside: a folder where this launcher and its ranks note the warnings they have shown
    (``$MULTILANE_WARNINGS_SHOWN``, errors.py), removed after (the environment as it was)."""
    import shutil
    import tempfile

    from multilane.engine.errors import WARNINGS_SHOWN_ENV

    if os.environ.get(WARNINGS_SHOWN_ENV):  # inside another launch of this process: its folder
        yield
        return
    folder = tempfile.mkdtemp(prefix="multilane-warnings-")
    os.environ[WARNINGS_SHOWN_ENV] = folder
    try:
        yield
    finally:
        os.environ.pop(WARNINGS_SHOWN_ENV, None)
        shutil.rmtree(folder, ignore_errors=True)


def _launch_ranks(args: argparse.Namespace, argv: list[str], config: Any) -> int:
    """A ddp/fsdp run from its launcher: the task, the refusals and the fit check once for every rank,
    then the ranks (engine/distributed/launcher.py). The run folder is made before the fit check, which
    runs the task's code (a hang there shows as "starting" and a stop reaches it)."""
    from multilane.engine.distributed import RUN_DIR_ENV
    from multilane.engine.distributed.launcher import launch
    from multilane.engine.tasks import make_task

    try:  # a bad task is one line here, not one per rank
        task = make_task(config.task.name, config.task.params)
    except UserError as e:
        if not args.resume or args.task is not None:
            raise
        from multilane.engine.rundir.runlog import CHECKPOINT

        where = Path(args.resume).expanduser() / CHECKPOINT
        raise UserError(f"resume: {where}: the task it was trained with cannot be made here: {e}") from None
    if config.devices.strategy == "fsdp":  # fp16 is refused here, not once per rank
        from multilane.engine.fsdp.units import mixed_precision

        mixed_precision(config.train.precision)

    from multilane.engine.tensors.features import check as check_features

    made: Path | None = None
    if not args.resume:  # will it fit (engine/plan/), once for every rank, before any starts
        from multilane.engine.distributed.worker import probe_loop
        from multilane.engine.plan.fit import check_fit
        from multilane.engine.plan.meter import FORECAST_ENV
        from multilane.engine.telemetry.devices import parse_devices

        os.environ.pop(FORECAST_ENV, None)  # an earlier launch's, in this process
        if args.nnodes == 1 and not os.environ.get(RUN_DIR_ENV):  # the folder first: the check runs task code
            from multilane.engine.distributed.launcher import processes_per_node

            processes_per_node(config)  # the machine can run it: refused before a folder is made

            def check() -> Any:  # both build the task's model (its code): in the run's folder, "starting"
                check_features(config, task)  # here, not once per rank (each rank checks it again)
                return check_fit(config, task, parse_devices(config.devices.use), probe_loop)

            forecast = _fit_in_its_folder(config, task, check)
            if forecast == "stopped":
                return 0
            made = Path(os.environ[RUN_DIR_ENV])
        else:
            check_features(config, task)
            forecast = check_fit(config, task, parse_devices(config.devices.use), probe_loop)
        if forecast is not None:  # each rank sets its own peak beside it (engine/plan/meter.py)
            os.environ[FORECAST_ENV] = json.dumps(forecast.to_dict())
    else:
        check_features(config, task)
    try:
        code = launch(
            argv, config, args.resume, args.nnodes, args.rdzv_endpoint, args.rdzv_timeout, args.rdzv_id, args.node_rank
        )
    except UserError:  # refused before a rank started, or by a rank in its set-up
        _drop_unbegun(made)
        raise
    if code == 2:
        _drop_unbegun(made)
    return code


def _drop_unbegun(made: Path | None) -> None:
    """A refused launch (the launcher said why, once, exit 2) leaves no folder for a run that never began:
    the one the fit check was made in goes, with the other ranks' "lost a peer" that would blame the wrong
    thing; a folder with a trained step stays."""
    status = _status_of(made) if made is not None else {}
    if made is not None and status.get("state") in ("starting", "failed") and not status.get("step"):
        import shutil

        shutil.rmtree(made, ignore_errors=True)


def cmd_train(args: argparse.Namespace, argv: list[str]) -> int:
    from multilane.engine.config import PROCESS_STRATEGIES
    from multilane.engine.distributed import in_worker
    from multilane.engine.errors import show_warnings_once

    show_warnings_once()  # a model's warning once, however often the filters change (errors.py)
    overrides = _overrides(args)
    if args.task is not None and "task.params" in overrides and overrides["task.params"] == {}:
        del overrides["task.params"]
    config = _run_config(args, overrides)  # checked before torch is imported, where it can be
    if config.devices.strategy in PROCESS_STRATEGIES:
        if in_worker():
            from multilane.engine.distributed.worker import run_rank

            return run_rank(None if args.resume else config, args.resume, overrides)
        import psutil
        from multilane.engine.distributed import COMMAND_START_ENV

        os.environ[COMMAND_START_ENV] = str(psutil.Process().create_time())  # the ranks' "X s in all"
        with _warnings_shown_folder():  # the launcher's and its ranks' warnings, each shown once
            return _launch_ranks(args, argv, config)
    if in_worker():
        raise UserError("started by torchrun: add --strategy ddp or fsdp (each process is one rank of the run)")
    from rich.console import Console

    # On a terminal, a spinner until the first step (imports, data and model take seconds); it goes
    # away when the progress bar starts or an error is printed, so an error stays one line.
    console = Console(stderr=True)
    waiting = console.status("loading torch, data and model…") if console.is_terminal else None
    if waiting is not None:
        waiting.start()
    try:
        # A press during these imports is held while torch or any C extension starts, and answered by
        # _stop_on_signals if its KeyboardInterrupt is lost on the way (cli/interrupts.py).
        from multilane.engine.display.progress import ProgressDisplay, summary
        from multilane.engine.distributed import RUN_DIR_ENV
        from multilane.engine.run.control import RunControl
        from multilane.engine.run.trainer import Trainer

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
        if result.traceback and (result.run_dir / "error.txt").is_file():  # a full disk may have kept it out
            print(f"  traceback: {result.run_dir / 'error.txt'}", file=sys.stderr)
        return 1
    if result.status == "aborted":
        return 130
    if result.status == DIVERGED:
        return EXIT_DIVERGED  # a non-finite loss or weights: the last checkpoint is the last finite state
    return 0


class _NameTaskFile(TrainerCallback):
    """Says which file is about to run, before it is imported."""

    def on_task_file(self, path: str) -> None:
        print(printable(f"running task file {path}"), flush=True)


def _fit_in_its_folder(config: Any, task: Any, check: Any) -> Any:
    """A ddp/fsdp launch's fit check (it runs the task's data() and build_model()) in the run's folder,
    made first and "starting" as a single-process run's set-up is: watch, control and the app see it,
    and a stop (Ctrl+C, SIGTERM, the control file) ends it there ("stopped"; returns "stopped"). The
    folder then goes to the launcher (``RUN_DIR_ENV``); a refusal leaves none, a crash says "failed"."""
    import contextlib
    import shutil
    import traceback

    from multilane.engine.distributed import RUN_DIR_ENV
    from multilane.engine.run.control import RunControl, SetupStopped
    from multilane.engine.run.failures import one_line, where
    from multilane.engine.rundir.control_file import ControlFile
    from multilane.engine.rundir.runlog import CONFIG, RunDir

    made_root = not Path(config.run.runs_dir).expanduser().exists()
    rd = RunDir.create(config.run.runs_dir, config.run.name)
    rd.write_json(CONFIG, config.to_dict())
    phase = "checking the fit"
    rd.set_status("starting", phase, phase=phase, step=0)
    control, file = RunControl(), ControlFile(rd.path)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    _stop_on_signals(control, _Quiet())
    try:
        with control.during_setup(lambda: file.apply(control)):
            forecast = check()
    except SetupStopped as e:
        why = f" ({e.args[0]})" if e.args and e.args[0] else ""
        rd.set_status(
            "stopped", f"stopped while {phase}, before step 1{why}; nothing was trained, no checkpoint", step=0
        )
        rd.close()
        print(f"stopped while {phase}: run directory {rd.path}")
        return "stopped"
    except KeyboardInterrupt:
        rd.set_status("aborted", f"aborted while {phase} (a second Ctrl+C or SIGTERM); nothing was trained", step=0)
        rd.close()
        raise
    except UserError:  # bad input found by the check: no folder, as a refusal leaves none
        rd.close()
        shutil.rmtree(rd.path, ignore_errors=True)
        if made_root:
            with contextlib.suppress(OSError):
                rd.path.parent.rmdir()
        raise
    except (Exception, SystemExit) as e:
        line = f"task {task.name}: setup failed{where(e)}: {one_line(e)}"
        rd.write_error("".join(traceback.format_exception(type(e), e, e.__traceback__)))
        rd.set_status("failed", line, step=0, phase=phase)
        rd.close()
        raise UserError(line) from None
    for s, handler in handlers.items():  # the launcher's own handling from here
        signal.signal(s, handler)
    rd.set_status("starting", "starting the ranks", phase="starting the ranks", step=0)
    rd.close()
    os.environ[RUN_DIR_ENV] = str(rd.path)
    return forecast


def _status_of(folder: Path) -> dict[str, Any]:
    try:
        data = json.loads((folder / "status.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


class _Quiet:
    def print(self, *args: Any, **kwargs: Any) -> None:
        print("stopping the run's set-up", file=sys.stderr, flush=True)


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
            console.print(
                "[yellow]stopping after this step, or at once while it sets up (press Ctrl+C again to abort)[/]"
            )
            control.request_stop()
        elif count == 2:
            raise KeyboardInterrupt
        else:
            os._exit(130)  # the abort itself is stuck: leave now, as a kill would

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    answer_missed_ctrl_c(on_signal)
