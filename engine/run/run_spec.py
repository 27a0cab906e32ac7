"""What a run trains: its config and task, from a config (and overrides) or a run folder's checkpoint
(checked before anything is written: bad input raises ``UserError``, one line), and its record in the
run folder."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from multilane.engine.config import RunConfig, build_config, merge
from multilane.engine.errors import UserError
from multilane.engine.run.callbacks import TrainerCallback
from multilane.engine.rundir.readfile import user_path
from multilane.engine.rundir.runlog import CHECKPOINT, CONFIG, ENVIRONMENT, TASK_FILE, RunDir
from multilane.engine.tasks import Task, make_task
from multilane.engine.tasks.loader import check_resume_task_file, is_task_file, task_file_record
from multilane.engine.telemetry.devices import Device, parse_devices
from multilane.engine.telemetry.envinfo import environment


@dataclass
class RunSpec:
    config: RunConfig
    task: Task
    task_file: dict[str, str] | None
    """``{"path", "sha256"}`` of a task file, else None."""
    devices: list[Device]
    checkpoint: dict[str, Any] | None
    """The checkpoint a resumed run continues from."""


def resolve_run(
    config: RunConfig | None,
    overrides: dict[str, Any],
    task: Task | None,
    resume_dir: RunDir | None,
    callbacks: Sequence[TrainerCallback] = (),
) -> RunSpec:
    """The run's config (``config`` with ``overrides``, or the checkpoint's in ``resume_dir``) and task."""
    expect_sha256 = None
    checkpoint = None
    if resume_dir is not None:
        checkpoint = resume_dir.load_checkpoint()
        config = build_config(merge(checkpoint["config"], overrides), "resume config")
        if task is None and is_task_file(config.task.name) and "task.name" not in overrides:
            # A run folder is data: its task file runs only as the run recorded it (or --task).
            recorded = resume_dir.read_json(TASK_FILE)
            expect_sha256 = check_resume_task_file(config.task.name, recorded)
    elif config is None:
        config = build_config(merge({}, overrides))
    elif overrides:
        config = build_config(merge(config.to_dict(), overrides))
    if task is None and is_task_file(config.task.name):
        # The full path, in the saved config too: a resume from another folder runs the same file.
        config = config.model_copy(deep=True)
        config.task.name = str(user_path(config.task.name, "task file").resolve())
        for cb in callbacks:
            cb.on_task_file(config.task.name)
    try:
        task = task or make_task(config.task.name, config.task.params, expect_sha256)
    except UserError as e:
        if resume_dir is None or "task.name" in overrides or "task.params" in overrides:
            raise
        # The task came from the checkpoint: the line names it, not only the task.
        raise UserError(
            f"resume: {resume_dir.path / CHECKPOINT}: the task it was trained with cannot be made here: {e}"
        ) from None
    if resume_dir is not None and checkpoint is not None:
        _same_run(resume_dir, checkpoint)
    devices = parse_devices(config.devices.use)
    if config.devices.output >= len(devices):
        raise UserError(
            f"devices.output = {config.devices.output}: only {len(devices)} device(s) listed ({config.devices.use})"
        )
    if config.devices.weights and len(config.devices.weights) != len(devices):
        raise UserError(f"devices.weights: {len(config.devices.weights)} weights for {len(devices)} devices")
    if config.train.precision == "fp16" and not devices[0].is_cuda:
        raise UserError("train.precision = fp16: fp16 needs a GPU; on CPU lanes use bf16 or fp32")
    return RunSpec(config, task, task_file_record(type(task)), devices, checkpoint)


def record_run(rd: RunDir, config: RunConfig, task_file: dict[str, str] | None) -> None:
    """Write what the run trains into its folder: config.json, task_file.json (a task file's path and
    hash, else none), environment.json."""
    rd.write_json(CONFIG, config.to_dict())
    if task_file is not None:
        rd.write_json(TASK_FILE, task_file)
    else:
        rd.remove(TASK_FILE)
    rd.write_json(ENVIRONMENT, environment())


def planned_steps(task: Task, config: RunConfig, per_epoch: int | None) -> int:
    """The run's optimizer steps: ``train.steps``, else ``train.epochs`` of ``per_epoch`` micro-batches."""
    if config.train.steps is None and per_epoch is None:
        raise UserError(
            f"task {task.name}: its data is a stream of unknown length (an IterableDataset): set train.steps"
        )
    return config.train.steps or math.ceil(config.train.epochs * (per_epoch or 0) / config.train.grad_accum)


def open_run_dir(resumed: RunDir | None, made: Path | None, config: RunConfig) -> RunDir:
    """The run's folder, its writer's lock held: the resumed one, the one whoever started this process
    made (the app, a sweep, a launcher: to follow it), or a new one."""
    if resumed is not None:
        return resumed
    if made is not None:
        rd = RunDir(made)
        if not rd.path.is_dir():
            raise UserError(f"run folder {rd.path} does not exist (it is made by whoever starts the run)")
        (rd.path / "checkpoints").mkdir(exist_ok=True)
        rd.acquire()
        return rd
    made_root = not Path(config.run.runs_dir).expanduser().exists()
    rd = RunDir.create(config.run.runs_dir, config.run.name)
    rd.made_root = made_root  # type: ignore[attr-defined]  # a refusal in set-up removes what it made
    return rd


def _same_run(rd: RunDir, checkpoint: dict[str, Any]) -> None:
    """A checkpoint whose task is not the one its run folder's config.json names is another run's
    (copied in, or the folder's files mixed up): refused, naming both, before anything is written."""
    folder = rd.read_json(CONFIG) or {}
    mine = folder.get("task", {}).get("name") if isinstance(folder.get("task"), dict) else None
    task = checkpoint["config"].get("task")
    theirs = task.get("name") if isinstance(task, dict) else None
    if isinstance(mine, str) and isinstance(theirs, str) and mine != theirs:
        raise UserError(
            f"checkpoint {rd.path / CHECKPOINT}: trained with task {theirs!r:.80}, but the run folder's "
            f"{CONFIG} names task {mine!r:.80} (another run's checkpoint?); nothing was changed"
        )
