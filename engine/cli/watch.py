"""``multilane watch RUN_DIR``: the live progress line of a run another process is writing.

It polls the run folder with ``RunFollower`` (incremental reads: only the bytes appended to
metrics.jsonl since the last refresh are parsed) and ends when the run does.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from multilane.engine.cli.progress import format_telemetry
from multilane.engine.errors import UserError
from multilane.engine.rundir.follow import RunFollower
from multilane.engine.rundir.runs_folder import run_folder_problem


class WatchState:
    """What the progress line shows, folded from the records as they arrive."""

    def __init__(self) -> None:
        self.step = 0
        self.total: int | None = None
        self.train: dict[str, Any] = {}
        self.eval: dict[str, Any] = {}
        self.telemetry = ""
        self.state = "waiting"
        self.message: str | None = None

    def add(self, rec: dict[str, Any]) -> None:
        kind = rec.get("kind")
        if kind == "train":
            self.train, self.step = rec, rec.get("step", self.step)
        elif kind == "eval":
            self.eval = rec
        elif kind == "telemetry":
            self.telemetry = format_telemetry(rec)
        elif kind == "event" and rec.get("event") == "started":
            self.total = rec.get("total_steps", self.total)
            self.step = rec.get("step", self.step)

    def set_status(self, status: dict[str, Any]) -> None:
        self.state = status.get("state", self.state)
        self.message = status.get("message")
        self.total = status.get("total_steps") or self.total
        if status.get("step") is not None:
            self.step = max(self.step, int(status["step"]))

    def line(self, telemetry: bool = True) -> str:
        parts = [f"{self.state}: step {self.step}" + (f"/{self.total}" if self.total else "")]
        if self.train:
            parts.append(f"loss {self.train['loss']:.4f}")
            if self.train.get("samples_per_s"):
                parts.append(f"{self.train['samples_per_s']:,.0f} samples/s")
        if self.eval:
            parts.append(f"val {self.eval['val_loss']:.4f}")
        text = " · ".join(parts)
        if self.telemetry and telemetry:
            text += " " + self.telemetry
        if self.message and self.state != "running":
            text += f" ({self.message})"
        return text


def watch(
    run_dir: str | Path,
    interval: float = 0.5,
    out: Any = None,
    follower: Any = None,
    on_interrupt: Callable[[], str] | None = None,
) -> int:
    """Follow ``run_dir`` until its run ends; 0 when it finished or stopped, 1 when it failed.

    ``follower``: another source with ``RunFollower``'s poll (a run on a host, through its mirror).
    ``on_interrupt``: what the first Ctrl+C does (it returns the line to show) before following on;
    without it, or at the second, Ctrl+C leaves."""
    out = out or sys.stdout
    folder = Path(run_dir).expanduser()
    if follower is None and not folder.is_dir():
        raise UserError(f"watch: {run_folder_problem(folder)}")
    follower, state = follower or RunFollower(folder), WatchState()
    tty = out.isatty()
    last = ""
    interrupted = False
    while True:
        try:
            update = follower.poll()
            for rec in update.records:
                state.add(rec)
            if update.status is not None:
                state.set_status(update.status)
            reconnecting = getattr(follower, "reconnecting", None)
            line = reconnecting or state.line()
            # Not on a terminal (a log, a pipe) a line is printed when the run moves (state, step, loss),
            # not each time only the telemetry's readings change: that printed one line a second.
            key = line if tty or reconnecting else state.line(telemetry=False)
            if key != last:
                out.write(("\r\x1b[2K" + line) if tty else line + "\n")
                out.flush()
                last = key
            if follower.done:
                break
            time.sleep(interval)
        except KeyboardInterrupt:
            if on_interrupt is None or interrupted:
                break
            interrupted = True
            out.write(("\n" if tty else "") + on_interrupt() + "\n")
            out.flush()
    if tty:
        out.write("\n")
    if follower.lost:
        out.write(f"{folder.name}: {follower.lost}\n")
        return 1
    return 1 if state.state == "failed" else 0
