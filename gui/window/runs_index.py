"""The runs table's rows: one summary per run folder under a runs folder. No Qt here.

What W&B's runs table and TensorBoard's HParams view show: status, the hyperparameters people vary,
final and best metrics, duration. Read from each folder's status.json, config.json and metrics.jsonl;
a folder that cannot be read becomes a row saying so, never an error.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from multilane.engine.rundir.runlog import iter_metrics

COLUMNS = [
    ("name", "run"),
    ("status", "status"),
    ("task", "task"),
    ("devices", "devices"),
    ("batch", "batch"),
    ("optimizer", "optimizer"),
    ("lr", "lr"),
    ("steps", "steps"),
    ("final_loss", "final loss"),
    ("best_val_loss", "best val loss"),
    ("final_metric", "final metric"),
    ("duration_s", "duration (s)"),
]


@dataclass
class RunSummary:
    path: Path
    name: str
    status: str = "?"
    task: str = ""
    devices: str = ""
    batch: float = math.nan
    optimizer: str = ""
    lr: float = math.nan
    steps: str = ""
    final_loss: float = math.nan
    best_val_loss: float = math.nan
    final_metric: float = math.nan
    metric_name: str = ""
    duration_s: float = math.nan
    started: float = 0.0
    notes: list[str] = field(default_factory=list)

    def value(self, key: str) -> Any:
        return getattr(self, key)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def summarize(run_dir: str | Path) -> RunSummary:
    """One run folder as a row of the runs table."""
    p = Path(run_dir)
    s = RunSummary(p, p.name)
    status = _read_json(p / "status.json")
    s.status = str(status.get("state") or "?")
    step, total = status.get("step"), status.get("total_steps")
    s.steps = f"{step}/{total}" if step is not None and total else (str(step) if step is not None else "")
    cfg = _read_json(p / "config.json")
    try:
        s.task = str(cfg["task"]["name"])
        s.devices = str(cfg["devices"]["use"])
        s.batch = float(cfg["data"]["batch_size"])
        s.optimizer = str(cfg["optim"]["name"])
        s.lr = float(cfg["optim"]["lr"])
    except (KeyError, TypeError, ValueError):
        s.notes.append("no readable config.json")
    first = last = None
    try:
        for rec in iter_metrics(p / "metrics.jsonl"):
            wall = rec.get("wall_time")
            if isinstance(wall, (int, float)):
                first = wall if first is None else first
                last = wall
            kind = rec.get("kind")
            if kind == "train" and isinstance(rec.get("loss"), (int, float)):
                s.final_loss = float(rec["loss"])
            elif kind == "eval":
                v = rec.get("val_loss")
                if isinstance(v, (int, float)) and math.isfinite(v):
                    s.best_val_loss = v if math.isnan(s.best_val_loss) else min(s.best_val_loss, v)
                for k, m in (rec.get("metrics") or {}).items():
                    if isinstance(m, (int, float)):
                        s.metric_name, s.final_metric = str(k), float(m)
                        break
    except (OSError, ValueError):
        s.notes.append("metrics.jsonl unreadable")
    if first is not None and last is not None:
        s.started, s.duration_s = first, last - first
    return s


def list_runs(runs_dir: str | Path) -> list[RunSummary]:
    """Every run folder directly under ``runs_dir`` (a folder with metrics.jsonl), newest first."""
    root = Path(runs_dir)
    try:
        folders = [d for d in root.iterdir() if d.is_dir() and (d / "metrics.jsonl").exists()]
    except OSError:
        return []
    rows = [summarize(d) for d in folders]
    rows.sort(key=lambda r: (r.started, r.name), reverse=True)
    return rows
