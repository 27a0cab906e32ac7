"""Reading a run folder, whatever is in it: every reader answers with data or one clear line.

A run folder is data from disk: a file may be torn by a kill, hold bytes that are not UTF-8, records
of the wrong shape, or be a folder. Readers skip a bad line of ``metrics.jsonl`` and count it
(``Metrics.skipped``); a JSON file that is not a JSON object reads as ``None``; a checkpoint is
checked field by field before a resume trusts it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from multilane.engine.errors import UserError
from multilane.engine.rundir.readfile import describe_os_error, read_regular_file
from multilane.engine.rundir.records import is_int, iter_lines, parse_record, record_problem

__all__ = ["Metrics", "iter_metrics", "load_metrics", "read_json", "read_metrics", "record_problem", "run_task_name"]

METRICS = "metrics.jsonl"
STATUS = "status.json"
CONFIG = "config.json"
ENVIRONMENT = "environment.json"
ERROR = "error.txt"
TASK_FILE = "task_file.json"
CHECKPOINT = "checkpoints/last.pt"

JSON_LIMIT = 16 << 20  # status, config, environment: a few KiB each; far larger is not ours
_is_int = is_int


@dataclass
class Metrics:
    records: list[dict[str, Any]] = field(default_factory=list)
    skipped: int = 0  # lines that are not a whole, well-formed record

    def skipped_note(self) -> str:
        s = self.skipped
        return f"{s} unreadable line{'s' if s != 1 else ''} skipped" if s else ""


def iter_metrics(path: str | Path, metrics: Metrics | None = None) -> Iterator[dict[str, Any]]:
    """Every whole, well-formed record of a metrics.jsonl, read in chunks (a file of any size); bad
    lines are skipped (and counted in ``metrics.skipped`` when given). ``UserError`` if the file is
    there but cannot be read."""
    path = Path(path)
    try:
        for raw in iter_lines(path):
            if not raw.strip():
                continue
            rec = parse_record(raw)
            if rec is None:
                if metrics is not None:
                    metrics.skipped += 1
                continue
            yield rec
    except FileNotFoundError:
        return
    except OSError as e:
        raise UserError(f"run {path.parent}: cannot read {path.name} ({describe_os_error(e)})") from None
    except ValueError as e:  # an embedded NUL in the path
        raise UserError(f"run {path.parent!r}: not a usable path ({e})") from None


def load_metrics(run_dir: str | Path) -> Metrics:
    """The run's records as they stand after resumes, with the count of lines skipped.

    When a run resumes from a checkpoint at step S, records it had logged past S (after that
    checkpoint, before the crash or stop) are superseded by the resumed run's own: they are dropped.
    So is the partial record a stop logs for its open log window (``"partial": true``): the
    checkpoint carries that window, and the resumed run logs it whole.
    """
    m = Metrics()
    out: list[dict[str, Any]] = []
    for rec in iter_metrics(Path(run_dir) / METRICS, m):
        s = rec.get("resumed_from_step") if rec["kind"] == "event" else None
        if s is not None:
            out = [r for r in out if r["kind"] in ("event", "telemetry") or not _superseded(r, s)]
        out.append(rec)
    m.records = out
    return m


def _superseded(rec: dict[str, Any], resumed_from: int) -> bool:
    step = rec.get("step") or 0
    return step > resumed_from or (step == resumed_from and rec.get("partial") is True)


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """``load_metrics(run_dir).records``."""
    return load_metrics(run_dir).records


def read_json(path: str | Path) -> dict[str, Any] | None:
    """A JSON object from a file, or None: missing, unreadable, not JSON, not an object."""
    try:
        data = json.loads(read_regular_file(path, JSON_LIMIT))
    except (OSError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def run_task_name(run_dir: str | Path) -> str | None:
    """The task named by a run folder's config.json, or None if it names none readably."""
    task = (read_json(Path(run_dir) / CONFIG) or {}).get("task")
    name = task.get("name") if isinstance(task, dict) else None
    return name if isinstance(name, str) else None


def _is_byte_state(t: Any) -> bool:
    import torch

    return isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1


def checkpoint_problem(ck: Any) -> str | None:
    """What a resume cannot use in a loaded checkpoint, or None."""
    import torch  # here, not at the top: `multilane watch` reads run folders without torch's 2 s import

    if not isinstance(ck, dict):
        return f"it holds a {type(ck).__name__}, not a table of the run's state"
    for key in ("model", "optimizer", "config"):
        if not isinstance(ck.get(key), dict):
            return f"no {key} state" if key not in ck else f"its {key} is a {type(ck[key]).__name__}"
    if not _is_int(ck.get("step")):
        return f"step = {ck.get('step')!r:.40}: not a whole number >= 0"
    if not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in ck["model"].items()):
        return "its model state is not tensors by name"
    if ck.get("total_steps") is not None and not _is_int(ck["total_steps"]):
        return "total_steps is not a whole number"
    if ck.get("total_steps") is not None and ck["step"] > ck["total_steps"]:
        return f"step {ck['step']} is past its total_steps {ck['total_steps']}"
    if ck.get("rng") is not None and not _is_byte_state(ck["rng"]):
        return "its random state is not a generator's state, a 1-d uint8 tensor"
    lane_rng = ck.get("lane_rng")
    if lane_rng is not None and not (
        isinstance(lane_rng, dict)
        and isinstance(lane_rng.get("lanes"), list)
        and all(s is None or (isinstance(s, list) and all(map(_is_byte_state, s))) for s in lane_rng["lanes"])
    ):
        return "its lanes' random states are not generators' states"
    if ck.get("metrics_window") is not None and not isinstance(ck["metrics_window"], dict):
        return "its metrics window is not a table"
    if ck.get("scaler") is not None and not isinstance(ck["scaler"], dict):
        return "its scaler state is not a table"
    return None
