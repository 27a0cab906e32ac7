"""The CLI's live progress display and its final summary (rich)."""

from __future__ import annotations

from typing import Any

from multilane.engine.trainer import RunResult, Trainer, TrainerCallback
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


class ProgressDisplay(TrainerCallback):
    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
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

    def on_train_start(self, trainer: Trainer) -> None:
        self.progress.start()
        lanes = ",".join(trainer.backend.lane_names)
        self._task_id = self.progress.add_task(
            f"{trainer.task.name} on {lanes}", total=trainer.total_steps, completed=trainer.step, info=""
        )

    def on_log(self, record: dict[str, Any]) -> None:
        sps = record.get("samples_per_s") or 0.0
        info = f"loss {record['loss']:.4f} {self._val}{sps:,.0f} samples/s{data_wait(record)} {self._tele}"
        self.progress.update(self._task_id, completed=record["step"], info=info)

    def on_telemetry(self, record: dict[str, Any]) -> None:
        self._tele = format_telemetry(record)

    def on_eval(self, record: dict[str, Any]) -> None:
        metrics = "".join(f" {k} {v:.3f}" for k, v in record["metrics"].items())
        self._val = f"val {record['val_loss']:.4f}{metrics} · "

    def on_event(self, record: dict[str, Any]) -> None:
        if record["event"] == "warning":
            self.console.print(f"[yellow]warning:[/] {record['message']}")
        if record["event"] in ("paused", "resumed") and self._task_id is not None:
            self.progress.update(self._task_id, info=record["event"])

    def on_train_end(self, result: RunResult) -> None:
        self.progress.stop()


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


def format_telemetry(record: dict[str, Any]) -> str:
    """A short line of what each device is doing: "· cuda:0 97% 41.2 GiB · cuda:1 95% 38.0 GiB"."""
    parts = []
    for name, d in record.get("devices", {}).items():
        rate = d.get("util_pct") or d.get("busy_pct")
        text = name + (f" {rate['mean']:.0f}%" if rate else "")
        if "mem_used_mb" in d:
            text += f" {d['mem_used_mb'] / 1024:.1f} GiB"
        parts.append(text)
    rss = record.get("process", {}).get("rss_mb")
    if rss is not None:
        parts.append(f"rss {rss / 1024:.1f} GiB")
    return "· " + " · ".join(parts) if parts else ""


def summary(result: RunResult, total_steps: int | None = None) -> str:
    """The final lines the CLI prints: outcome, losses, metric, time, run directory."""
    lines = [
        f"{result.status}: step {result.step}"
        + (f"/{total_steps}" if total_steps else "")
        + f" in {result.elapsed_s:.1f} s"
    ]
    if result.message:
        lines.append(f"  {result.message}")
    t = result.last_train
    if t:
        per = ", ".join(f"{k} {v:.4f}" for k, v in t.get("device_loss", {}).items())
        lines.append(f"  final train loss {t['loss']:.4f} ({per})")
    e = result.last_eval
    if e:
        metrics = "".join(f", {k} {v:.4f}" for k, v in e.get("metrics", {}).items())
        lines.append(f"  validation loss {e['val_loss']:.4f}{metrics}")
    lines.append(f"  run directory: {result.run_dir}")
    return "\n".join(lines)
