"""What the trainer reports through: plain callbacks (no Qt), the run's result, the metrics writer.

The run directory writer, the CLI's progress display and the app's worker are all ``TrainerCallback``s.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from multilane.engine.run.trainer import Trainer
    from multilane.engine.rundir.runlog import RunDir


class TrainerCallback:
    """Hooks the trainer calls, named after the points they mark. Override what you need.

    Records are plain dicts (the same ones written to metrics.jsonl). Hooks run in the training
    thread: keep them short, and never touch a widget from them.
    """

    def on_task_file(self, path: str) -> None:
        """A task file (its full path) is about to be imported, that is, run."""

    def on_train_start(self, trainer: Trainer) -> None: ...

    def on_log(self, record: dict[str, Any]) -> None:
        """Train metrics, every ``log_every`` steps."""

    def on_eval(self, record: dict[str, Any]) -> None:
        """Validation loss and the task's metrics."""

    def on_event(self, record: dict[str, Any]) -> None:
        """Lifecycle: started, paused, resumed, stopped, finished, failed; and warnings."""

    def on_telemetry(self, record: dict[str, Any]) -> None:
        """Device readings, from the sampler's own thread (not the training thread)."""

    def on_health(self, record: dict[str, Any]) -> None:
        """A sampled step's per-layer health (grouped rows; ``record["layers"]``: every layer's values)."""

    def on_train_end(self, result: RunResult) -> None: ...


@dataclass
class RunResult:
    status: str  # finished | stopped | diverged | failed | aborted
    step: int
    run_dir: Path
    message: str | None = None
    traceback: str | None = None
    last_train: dict[str, Any] = field(default_factory=dict)
    last_eval: dict[str, Any] = field(default_factory=dict)
    elapsed_s: float = 0.0
    memory: dict[str, Any] | None = None
    """Each memory's peak, ``{name: {"forecast", "measured"}}`` in bytes, where the run had a forecast."""


HEALTH_LAYERS = "health_layers.jsonl"
"""Every layer's sampled health, one line per sampled step (metrics.jsonl holds the grouped rows)."""


def split_health(record: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """A monitor's ``health`` record as the run folder keeps it: the grouped record for metrics.jsonl,
    and the line of every layer's values for ``HEALTH_LAYERS`` (None when it has none). The engine's
    trainers and the integrations' recorders write through this one function."""
    rec = {k: v for k, v in record.items() if k != "layers"}
    layers = record.get("layers")
    return rec, (json.dumps(layers, separators=(",", ":")) + "\n") if layers else None


STATUS_EVERY_S = 1.0
"""At most how often ``status.json``'s step follows the train records (an atomic, fsynced rewrite)."""


class MetricsWriter(TrainerCallback):
    """Appends every record to the run's metrics.jsonl, and keeps ``status.json``'s step current at
    log time (at most once every ``STATUS_EVERY_S``): a reader of status.json alone sees how far the
    run is, not the step it started at."""

    def __init__(self, run_dir: RunDir) -> None:
        self.run_dir = run_dir
        self._trainer: Trainer | None = None
        self._status_at = time.monotonic()

    def on_train_start(self, trainer: Trainer) -> None:
        self._trainer = trainer

    def on_log(self, record: dict[str, Any]) -> None:
        self.run_dir.append_metric(record)
        if self._trainer is not None and not record.get("partial"):
            self.keep_status(record.get("step"), getattr(self._trainer, "total_steps", None))

    def keep_status(self, step: Any, total: int | None) -> None:
        """``status.json``'s step current, at most once every ``STATUS_EVERY_S`` (the loop's, a recorder's)."""
        now = time.monotonic()
        if now - self._status_at >= STATUS_EVERY_S:
            self._status_at = now
            self.run_dir.set_status("running", step=step, total_steps=total)

    def on_record(self, record: dict[str, Any]) -> None:
        self.run_dir.append_metric(record)

    def on_health(self, record: dict[str, Any]) -> None:
        """The grouped record into metrics.jsonl; every layer's values into health_layers.jsonl."""
        rec, layers = split_health(record)
        self.run_dir.append_metric(rec)
        if layers is not None:
            self.run_dir.append_text(HEALTH_LAYERS, layers)

    on_eval = on_record
    on_event = on_record
    on_telemetry = on_record
