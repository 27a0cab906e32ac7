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

from multilane.engine.cli.interrupts import missed_ctrl_c
from multilane.engine.display.device_line import DeviceTelemetry
from multilane.engine.display.terminal_text import printable
from multilane.engine.errors import EXIT_DIVERGED, UserError
from multilane.engine.health.noise_scale import noise_text
from multilane.engine.numbers import format_number
from multilane.engine.rundir.follow import DIVERGED, RunFollower
from multilane.engine.rundir.readfile import user_path
from multilane.engine.rundir.runs_folder import NOT_A_RUN, run_folder_problem, says_it_is_a_run


def format_health(record: dict[str, Any]) -> str:
    """The sampled health in a few words: the largest update-to-weight ratio and its layer, and the
    deadest activation ("update/weight 3.1e-03 at head.1 · 62% zeros at features.1 (ReLU)")."""
    parts = []
    ratios = [(v, r) for v, r in zip(record.get("update_ratio") or [], record.get("rows") or [], strict=False) if v]
    if ratios:
        v, row = max(ratios)
        parts.append(f"update/weight {v:.1e} at {row}")
    zeros = [(v, r) for v, r in zip(record.get("act_zero") or [], record.get("act_rows") or [], strict=False) if v]
    if zeros:
        v, row = max(zeros)
        parts.append(f"{100 * v:.0f}% zeros at {row}")
    return " · ".join(parts)


class WatchState:
    """What the progress line shows, folded from the records as they arrive."""

    def __init__(self) -> None:
        self.step = 0
        self.total: int | None = None
        self.train: dict[str, Any] = {}
        self.eval: dict[str, Any] = {}
        self.telemetry = ""
        self._devices = DeviceTelemetry()
        self.health = ""
        self.state = "waiting"
        self.message: str | None = None

    def add(self, rec: dict[str, Any]) -> None:
        """One record, already checked by the follower (``records.py``: steps whole, losses numbers
        or null)."""
        kind = rec.get("kind")
        if kind == "train":
            self.train, self.step = rec, rec.get("step", self.step)
        elif kind == "eval":
            self.eval = rec
        elif kind == "telemetry":
            self.telemetry = self._devices.add(rec)
        elif kind == "health":
            self.health = format_health(rec)
        elif kind == "event" and rec.get("event") == "started":
            self._devices.restart(rec.get("lanes"))
            self.total = rec.get("total_steps", self.total)
            self.step = rec.get("step", self.step)

    def set_status(self, status: dict[str, Any]) -> None:
        """A status as the follower passes it on (``clean_status``: a state, whole steps)."""
        self.state = status.get("state", self.state)
        self.message = status.get("message")
        self.total = status.get("total_steps") or self.total
        if status.get("step") is not None:
            self.step = max(self.step, status["step"])

    def line(self, telemetry: bool = True) -> str:
        parts = [f"{self.state}: step {self.step}" + (f"/{self.total}" if self.total else "")]
        if "loss" in self.train:
            parts.append(f"loss {_value(self.train['loss'])}")  # null: the run's loss was NaN or inf
            if self.train.get("samples_per_s"):
                parts.append(f"{self.train['samples_per_s']:,.0f} samples/s")
            if isinstance(self.train.get("tokens_per_s"), (int, float)):  # a language model's run
                parts.append(f"{self.train['tokens_per_s']:,.0f} tokens/s")
        if "val_loss" in self.eval:
            parts.append(f"val {_value(self.eval['val_loss'])}")
            if "perplexity" in self.eval:
                parts.append(f"perplexity {_value(self.eval['perplexity'])}")
        noise = self.train.get("noise")
        if isinstance(noise, dict) and (said := noise_text(noise)) is not None:
            parts.append(said)
        if self.health:
            parts.append(self.health)
        text = " · ".join(parts)
        if self.telemetry and telemetry:
            text += " " + self.telemetry
        if self.message and self.state != "running":
            text += f" ({self.message})"
        return text


def _value(v: float | None) -> str:
    return "nan" if v is None else format_number(v)  # null in a record: the run's loss was NaN or inf


RUN_FILES = ("metrics.jsonl", "status.json", "config.json", "checkpoints", ".lock")


def check_run_folder(folder: Path) -> None:
    """Refuse, in one line, what is not a run folder: a file, nothing, or the runs folder itself."""
    try:
        if not folder.is_dir():
            raise UserError(f"watch: {run_folder_problem(folder)}")
        odd = [n for n in RUN_FILES[:2] if (folder / n).exists() and not (folder / n).is_file()]
        if says_it_is_a_run(folder) or odd:
            return  # a metrics.jsonl or status.json that is no file: the follower says what it is
        runs = [p for p in folder.iterdir() if p.is_dir() and any((p / n).exists() for n in RUN_FILES[:3])]
    except ValueError as e:  # an embedded NUL
        raise UserError(f"watch: not a usable path ({e})") from None
    except OSError as e:
        raise UserError(f"watch: {folder}: cannot read it ({e.strerror or e})") from None
    if runs:
        newest = max(runs, key=lambda p: p.stat().st_mtime)
        raise UserError(
            f"watch: {folder} is a runs folder, not a run; watch one of its {len(runs)} runs, e.g. {newest}"
        )
    raise UserError(f"watch: {folder} is not a run folder ({NOT_A_RUN})")


def watch(
    run_dir: str | Path,
    interval: float = 0.5,
    out: Any = None,
    follower: Any = None,
    on_interrupt: Callable[[], str] | None = None,
) -> int:
    """Follow ``run_dir`` until its run ends; 0 when it finished or stopped, 1 when it failed or its
    writer is gone, 3 (``EXIT_DIVERGED``) when its loss or weights went non-finite. A folder that
    cannot be followed (its metrics.jsonl a FIFO or a folder) is one line (``UserError``).

    ``follower``: another source with ``RunFollower``'s poll (a run on a host, through its mirror).
    ``on_interrupt``: what the first Ctrl+C does (it returns the line to show) before following on;
    without it, or at the second, Ctrl+C leaves."""
    out = out or sys.stdout
    folder = user_path(run_dir, "watch")
    if follower is None:
        check_run_folder(folder)
    follower, state = follower or RunFollower(folder), WatchState()
    tty = out.isatty()
    last = ""
    interrupted = False
    while True:
        try:
            if missed_ctrl_c():  # a press whose KeyboardInterrupt a library or a finalizer lost
                raise KeyboardInterrupt
            update = follower.poll()
            said = []  # the run's own warnings (an MLflow server out of reach), one line each
            for rec in update.records:
                state.add(rec)
                if rec.get("kind") == "event" and rec.get("event") == "warning":
                    said.append(str(rec.get("message")))
            if update.status is not None:
                state.set_status(update.status)
            # and the follower's: a link or FIFO in a file's place there
            for warning in said + getattr(follower, "new_warnings", list)():
                if tty:
                    out.write("\r\x1b[2K")
                    out.flush()
                    last = ""
                print(f"multilane: warning: {printable(warning)}", file=sys.stderr, flush=True)
            reconnecting = getattr(follower, "reconnecting", None)
            catching_up = getattr(follower, "catching_up", None)
            line = printable(reconnecting or state.line() + (f" · {catching_up}" if catching_up else ""))
            # Not on a terminal (a log, a pipe) a line is printed when the run moves (state, step, loss),
            # not each time only the telemetry's readings change: that printed one line a second.
            key = line if tty or reconnecting or catching_up else state.line(telemetry=False)
            if key != last:
                out.write(("\r\x1b[2K" + line) if tty else line + "\n")
                out.flush()
                last = key
            if follower.done:
                break
            time.sleep(interval)
        except KeyboardInterrupt:
            missed_ctrl_c()  # answered here
            if on_interrupt is None or interrupted:
                break
            interrupted = True
            out.write(("\n" if tty else "") + printable(on_interrupt()) + "\n")
            out.flush()
    if tty:
        out.write("\n")
    if follower.problem:
        raise UserError(f"watch: {folder}: {follower.problem}")
    if follower.lost:
        out.write(printable(f"{folder.name}: {follower.lost}") + "\n")
        return 1
    if follower.metrics.skipped:
        n = follower.metrics.skipped
        print(
            f"multilane: warning: {folder / 'metrics.jsonl'}: {n} unreadable line{'s' if n != 1 else ''} skipped",
            file=sys.stderr,
        )
    if state.state == DIVERGED:
        return EXIT_DIVERGED
    return 1 if state.state in ("failed", "aborted") else 0
