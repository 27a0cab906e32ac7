"""What the trainer reports through: plain callbacks (no Qt), the run's result, the metrics writer.

The run directory writer, the CLI's progress display and the app's worker are all ``TrainerCallback``s.
"""

from __future__ import annotations

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

    def on_train_end(self, result: RunResult) -> None: ...


@dataclass
class RunResult:
    status: str  # finished | stopped | failed
    step: int
    run_dir: Path
    message: str | None = None
    traceback: str | None = None
    last_train: dict[str, Any] = field(default_factory=dict)
    last_eval: dict[str, Any] = field(default_factory=dict)
    elapsed_s: float = 0.0


class MetricsWriter(TrainerCallback):
    """Appends every record to the run's metrics.jsonl."""

    def __init__(self, run_dir: RunDir) -> None:
        self.run_dir = run_dir

    def on_log(self, record: dict[str, Any]) -> None:
        self.run_dir.append_metric(record)

    on_eval = on_log
    on_event = on_log
    on_telemetry = on_log
