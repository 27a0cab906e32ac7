"""A run's training time and its end-of-run summary, folded from its records. No Qt here.

**Training time** is the one duration the window and the runs table show: the wall time from each
``started`` event (set-up done) to the last record of that stretch, less the time spent paused. A
stop and a later resume leave the time in between out; so is set-up (imports, data, model). Every
record of the file counts, also those a resume superseded: they took training time too.

**Best** follows the value's direction: losses and most metrics are better lower; metrics named like
accuracy, r2, f1, auc, precision, recall, iou, bleu are better higher.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from multilane.engine.rundir.follow import DIVERGED

HIGHER_IS_BETTER = ("acc", "r2", "f1", "auc", "precision", "recall", "iou", "bleu", "map", "top")


def higher_is_better(name: str) -> bool:
    n = name.lower()
    return any(n == w or n.startswith(w) or n.endswith(w) for w in HIGHER_IS_BETTER)


class TrainingClock:
    """Training time from records as they come (``add``), live (``seconds(now)``) or after the run."""

    def __init__(self) -> None:
        self.closed = 0.0  # stretches that ended: a stop, a crash, a pause
        self.start: float | None = None  # the open stretch began (wall time); None while not training
        self.last: float | None = None  # the last record's wall time in the open stretch
        self.paused = False

    def add(self, rec: dict[str, Any]) -> None:
        wall = rec.get("wall_time")
        if not isinstance(wall, (int, float)) or isinstance(wall, bool):
            return
        event = rec.get("event") if rec.get("kind") == "event" else None
        if event == "started":
            self._close()
            self.start, self.last, self.paused = wall, wall, False
            return
        if self.start is None:
            return
        self.last = max(self.last or wall, wall)
        if event == "paused" and not self.paused:
            self._close()
            self.start, self.last, self.paused = wall, wall, True
        elif event == "resumed" and self.paused:
            self.start, self.last, self.paused = wall, wall, False
        elif event in ("finished", "stopped", "failed", DIVERGED):
            self._close()

    def _close(self) -> None:
        if self.start is not None and self.last is not None and not self.paused:
            self.closed += max(0.0, self.last - self.start)
        self.start = self.last = None
        self.paused = False

    def seconds(self, now: float | None = None) -> float:
        """Training time so far; ``now`` (wall time) counts a run that trains at this moment to now."""
        open_s = 0.0
        if self.start is not None and not self.paused:
            end = self.last if now is None else max(now, self.last or now)
            open_s = max(0.0, end - self.start)
        return self.closed + open_s

    @classmethod
    def of(cls, records: Iterable[dict[str, Any]]) -> TrainingClock:
        clock = cls()
        for rec in records:
            clock.add(rec)
        return clock


@dataclass
class Series:
    """One value over a run: its last, its best and the step of the best."""

    name: str
    higher_better: bool
    final: float = math.nan
    best: float = math.nan
    best_step: int | None = None

    def add(self, step: int, v: Any) -> None:
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            return
        self.final = float(v)
        better = v > self.best if self.higher_better else v < self.best
        if self.best_step is None or better:
            self.best, self.best_step = float(v), step


@dataclass
class RunSummary:
    """What a run came to: per value final, best and its step; how it ended; time and throughput."""

    state: str = ""
    message: str = ""
    step: int = 0
    total_steps: int | None = None
    training_s: float = 0.0
    samples_per_s: float = math.nan  # mean over the training steps (eval and pauses not counted)
    series: dict[str, Series] = field(default_factory=dict)
    memory: list[str] = field(default_factory=list)
    """The forecast beside the measured peak, one line per memory (a ``memory`` event; engine/plan/)."""
    split: list[str] = field(default_factory=list)
    """Each device's memory at the last log: parameters, gradients, optimizer state, the rest (a train
    record's ``memory``; engine/telemetry/memory_split.py): what fsdp's sharding saves, per device."""

    def value(self, name: str) -> Series:
        s = self.series.get(name)
        if s is None:
            s = self.series[name] = Series(name, higher_is_better(name) and "loss" not in name)
        return s

    def stop_reason(self) -> str:
        """One line: finished, stopped (by whom or why), failed (why), or still going."""
        if self.state == "finished":
            return f"finished all {self.total_steps or self.step:,} steps"
        if self.message:
            return f"{self.state}: {self.message}" if not self.message.startswith(self.state) else self.message
        if self.state in ("stopped", "failed", DIVERGED):
            return f"{self.state} at step {self.step:,}"
        return self.state or "unknown"


def summarize_records(records: Iterable[dict[str, Any]], status: dict[str, Any] | None = None) -> RunSummary:
    """The summary of a run's records (as ``load_metrics`` gives them) and its status.json."""
    s = RunSummary()
    clock = TrainingClock()
    samples = seconds = 0.0
    prev_step = 0
    for rec in records:
        clock.add(rec)
        kind, step = rec.get("kind"), rec.get("step")
        if kind == "event" and rec.get("event") == "started":
            prev_step = step if isinstance(step, int) else prev_step
            s.total_steps = rec.get("total_steps") or s.total_steps
        if kind == "event" and rec.get("event") == "memory":
            s.memory = memory_lines(rec.get("peaks"))
        if not isinstance(step, int):
            continue
        if kind == "train":
            s.step = max(s.step, step)
            if isinstance(rec.get("memory"), dict):
                s.split = split_lines(rec["memory"]) or s.split
            s.value("loss").add(step, rec.get("loss"))
            sps, ms = rec.get("samples_per_s"), rec.get("step_ms")
            n = step - prev_step
            if isinstance(sps, (int, float)) and isinstance(ms, (int, float)) and n > 0 and ms > 0:
                samples += n * sps * ms / 1000  # samples per step x steps
                seconds += n * ms / 1000
            prev_step = step
        elif kind == "eval":
            s.value("val_loss").add(step, rec.get("val_loss"))
            for name, v in (rec.get("metrics") or {}).items():
                s.value(str(name)).add(step, v)
            if "perplexity" in rec:  # a language model's
                s.value("perplexity").add(step, rec["perplexity"])
    status = status or {}
    s.state = str(status.get("state") or "")
    s.message = str(status.get("message") or "")
    if isinstance(status.get("step"), int):
        s.step = max(s.step, status["step"])
    s.total_steps = status.get("total_steps") or s.total_steps
    s.training_s = clock.seconds()
    if seconds > 0:
        s.samples_per_s = samples / seconds
    return s


def fmt_duration(s: float) -> str:
    """ "4.2 s" under a minute, then m:ss, and h:mm:ss from an hour on: the window's status line, the
    summary and the runs table say it alike."""
    if not math.isfinite(s):
        return ""
    if s < 60:
        return f"{max(0.0, s):.1f} s"
    s = int(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def memory_lines(peaks: Any) -> list[str]:
    """ "peak tensor memory cpu: 5.5 MiB measured, 5.5 MiB forecast (-1.0 %)" for each memory of a ``memory``
    event's ``peaks`` (read from disk: anything else is left out)."""
    out = []
    for name, r in peaks.items() if isinstance(peaks, dict) else ():
        m, f = (r.get(k) if isinstance(r, dict) else None for k in ("measured", "forecast"))
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 1e18 for v in (m, f)):
            continue
        from multilane.engine.plan.forecast import small_difference  # under 1 MiB: in bytes, as the CLI's

        err = small_difference(f, m) or f"{(f - m) / m:+.1%}"
        out.append(f"peak tensor memory {str(name)[:40]}: {_size(m)} measured, {_size(f)} forecast ({err})")
    return out


def split_lines(memory: Any) -> list[str]:
    """ "memory cpu:0: params 1.2 MiB · grads 1.2 MiB · optimizer 2.4 MiB" per device of a train record's
    ``memory`` (the CLI summary's words; read from disk: a device whose parts are not byte counts is left out)."""
    from multilane.engine.telemetry.memory_split import KINDS, summary_lines

    def count(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1e18

    good = {
        str(name)[:60]: m
        for name, m in memory.items()
        if isinstance(m, dict) and all(count(m.get(k)) for k in KINDS) and (m.get("rest") is None or count(m["rest"]))
    }
    return [line.strip() for line in summary_lines(good)]


def _size(n: float) -> str:
    from multilane.engine.plan.forecast import gib  # the CLI summary's units: B, KiB, MiB, GiB

    return gib(n)
