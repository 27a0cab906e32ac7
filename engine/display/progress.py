"""The live progress display of a run training in this process and its final summary (rich), shown by
``multilane train`` and by rank 0 of a ddp or fsdp run; ``data_wait`` is the window's note too."""

from __future__ import annotations

import time
from typing import Any

import psutil
from multilane.engine.display.device_line import DeviceTelemetry
from multilane.engine.display.terminal_text import printable
from multilane.engine.numbers import format_number
from multilane.engine.plan.meter import memory_lines
from multilane.engine.run.trainer import RunResult, Trainer, TrainerCallback
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


class ProgressDisplay(TrainerCallback):
    """A live bar on a terminal; off one (a log file, a pipe, CI), plain full lines every few seconds."""

    PLAIN_EVERY_S = 5.0

    def __init__(self, console: Console | None = None, waiting: Any = None, started: float | None = None) -> None:
        self._started = started  # when the command began (a rank's launcher), else this process's start
        self.console = console or Console(stderr=True)
        self._waiting = waiting  # a rich Status shown until training starts
        self.live = self.console.is_terminal
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(bar_width=20),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=self.console,
            transient=False,
        )
        self._task_id: Any = None
        self._val = ""
        self._tele = ""
        self._devices = DeviceTelemetry()
        self._last: dict[str, Any] | None = None
        self._total = 0
        self._printed_at = 0.0
        self._t_train_start: float | None = None
        self._t_end: float | None = None

    def on_train_start(self, trainer: Trainer) -> None:
        self.stop_waiting()
        self._t_train_start = time.time()
        self._total = trainer.total_steps
        lanes = ",".join(trainer.lane_names)
        description = f"{trainer.task.name} on {lanes}"  # a task file's name is data: escaped below
        if not self.live:
            self._plain(printable(f"{description}: {trainer.total_steps} steps from step {trainer.step}"))
            return
        description = _safe(description)
        self.progress.start()
        self._task_id = self.progress.add_task(description, total=trainer.total_steps, completed=trainer.step, info="")

    def _info(self) -> str:
        r = self._last
        if r is None:
            return ""
        sps = r.get("samples_per_s") or 0.0
        info = f"loss {format_number(r['loss'])} {self._val}{sps:,.0f} samples/s{data_wait(r)} {self._tele}".rstrip()
        return info if not self.live else _safe(info)  # the bar reads rich markup: a task's "[" is text

    def _show(self, force: bool = False) -> None:
        if self._last is None:
            return
        if self.live:
            self.progress.update(self._task_id, completed=self._last["step"], info=self._info())
            return
        now = time.monotonic()
        if force or now - self._printed_at >= self.PLAIN_EVERY_S:
            self._plain(printable(f"step {self._last['step']}/{self._total} · {self._info()}"))

    def _plain(self, line: str) -> None:
        self._printed_at = time.monotonic()
        print(line, file=self.console.file, flush=True)

    def on_log(self, record: dict[str, Any]) -> None:
        self._last = record
        self._show()

    def on_telemetry(self, record: dict[str, Any]) -> None:
        self._tele = self._devices.add(record)

    def on_eval(self, record: dict[str, Any]) -> None:
        metrics = "".join(f" {k} {format_number(v, 3)}" for k, v in record["metrics"].items())
        self._val = f"val {format_number(record['val_loss'])}{metrics} · "
        # An evaluation comes after its step's log line: show it now, or the line keeps an old one.
        self._show()

    def on_event(self, record: dict[str, Any]) -> None:
        if record["event"] == "warning":
            self.console.print(f"[yellow]warning:[/] {_safe(str(record['message']))}")
        if record["event"] in ("paused", "resumed"):
            if self._task_id is not None:
                self.progress.update(self._task_id, info=record["event"])
            elif not self.live:
                self._plain(f"{record['event']} at step {record['step']}")

    def stop_waiting(self) -> None:
        """End the "loading…" spinner (idempotent)."""
        if self._waiting is not None:
            self._waiting.stop()
            self._waiting = None

    def on_train_end(self, result: RunResult) -> None:
        self.stop_waiting()
        self._t_end = time.time()
        if self.live:
            self.progress.stop()
        else:
            self._show(force=True)  # the last line, with the last validation

    def timing(self) -> dict[str, float]:
        """Seconds: ``total`` since the process started, ``to_first_step`` of it before training began
        (imports, data, model), ``training`` from the first step to the end."""
        start = self._started or psutil.Process().create_time()
        end = self._t_end or time.time()
        out = {"total": end - start}
        if self._t_train_start is not None:
            out["to_first_step"] = self._t_train_start - start
            out["training"] = end - self._t_train_start
        return out


def _safe(text: str) -> str:
    """Text of the task's (its name, metric names, a warning) for a rich line: escaped for the terminal
    (``printable``) and for rich's markup, so ``[/]`` in a metric's name neither styles nor breaks it."""
    return escape(printable(text))


DATA_WAIT_SHOWN = 0.05
"""Waiting on data is shown once it takes this share of the step time."""


def data_wait(record: dict[str, Any]) -> str:
    """ " · waiting on data 42%" when a train record's steps spent a noticeable share waiting for the next
    batch (``phase_ms["data"]`` over ``step_ms``), else ""."""
    wait = (record.get("phase_ms") or {}).get("data")
    step = record.get("step_ms")
    if not wait or not step or wait / step < DATA_WAIT_SHOWN:
        return ""
    return f" · waiting on data {min(1.0, wait / step):.0%}"


def summary(result: RunResult, total_steps: int | None = None, timing: dict[str, float] | None = None) -> str:
    """The final lines the CLI prints: outcome, time, losses, metric, run directory."""
    head = f"{result.status}: step {result.step}" + (f"/{total_steps}" if total_steps else "")
    if timing and "training" in timing:
        head += (
            f" · training {timing['training']:.1f} s · {timing['total']:.1f} s in all"
            f" ({timing['to_first_step']:.1f} s to the first step: imports, data, model)"
        )
    else:
        head += f" · training {result.elapsed_s:.1f} s"
    lines = [head]
    if result.message:
        lines.append(f"  {result.message}")
    t = result.last_train
    if t:
        per = ", ".join(f"{k} {format_number(v)}" for k, v in t.get("device_loss", {}).items())
        lines.append(f"  final train loss {format_number(t['loss'])} ({per})")
        if t.get("memory"):
            from multilane.engine.telemetry.memory_split import summary_lines

            lines += summary_lines(t["memory"])
    e = result.last_eval
    if e:
        metrics = "".join(f", {k} {format_number(v)}" for k, v in e.get("metrics", {}).items())
        lines.append(f"  validation loss {format_number(e['val_loss'])}{metrics}")
    lines += [f"  {line}" for line in memory_lines(result.memory)]
    lines.append(f"  run directory: {result.run_dir}")
    return "\n".join(printable(line) for line in lines)  # a task's message or metric names: shown, not obeyed
