"""``multilane watch RUN_DIR``: the live progress line of a run another process is writing.

It polls the run folder with ``RunFollower`` (incremental reads: only the bytes appended to
metrics.jsonl since the last refresh are parsed) and ends when the run does.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from multilane.engine.cli.progress import format_telemetry
from multilane.engine.errors import UserError
from multilane.engine.numbers import format_number
from multilane.engine.rundir.follow import RunFollower


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

    def line(self) -> str:
        parts = [f"{self.state}: step {self.step}" + (f"/{self.total}" if self.total else "")]
        if self.train:
            parts.append(f"loss {format_number(self.train['loss'])}")
            if self.train.get("samples_per_s"):
                parts.append(f"{self.train['samples_per_s']:,.0f} samples/s")
        if self.eval:
            parts.append(f"val {format_number(self.eval['val_loss'])}")
        text = " · ".join(parts)
        if self.telemetry:
            text += " " + self.telemetry
        if self.message and self.state != "running":
            text += f" ({self.message})"
        return text


def watch(run_dir: str | Path, interval: float = 0.5, out: Any = None) -> int:
    """Follow ``run_dir`` until its run ends; 0 when it finished or stopped, 1 when it failed."""
    out = out or sys.stdout
    folder = Path(run_dir).expanduser()
    if not folder.is_dir():
        raise UserError(f"watch: {folder} is not a run folder")
    follower, state = RunFollower(folder), WatchState()
    tty = out.isatty()
    last = ""
    try:
        while True:
            update = follower.poll()
            for rec in update.records:
                state.add(rec)
            if update.status is not None:
                state.set_status(update.status)
            line = state.line()
            if line != last:
                out.write(("\r\x1b[2K" + line) if tty else line + "\n")
                out.flush()
                last = line
            if follower.done:
                break
            time.sleep(interval)
    except KeyboardInterrupt:
        pass
    if tty:
        out.write("\n")
    if follower.lost:
        out.write(f"{folder.name}: {follower.lost}\n")
        return 1
    return 1 if state.state == "failed" else 0
