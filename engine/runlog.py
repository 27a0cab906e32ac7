"""The run directory: config, environment, metrics.jsonl, status, checkpoints. Crash-safe by design.

- ``metrics.jsonl`` gets one JSON record per line, each written with a single ``write`` on an
  O_APPEND file, so a process killed at any moment leaves every complete line parseable;
  ``read_metrics`` skips a torn last line.
- ``status.json`` and ``checkpoints/last.pt`` are written to a temporary file, fsynced and renamed
  over the old one: a reader sees the old file or the new one, never half of one.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from multilane.engine.errors import UserError

METRICS = "metrics.jsonl"
STATUS = "status.json"
CONFIG = "config.json"
ENVIRONMENT = "environment.json"
ERROR = "error.txt"
SAMPLES = "samples.txt"
CHECKPOINT = "checkpoints/last.pt"


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _json_safe(value: Any) -> Any:
    """NaN and inf become null: strict JSON readers (browsers, jq) must parse every line."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def check_writable(folder: Path) -> None:
    """Refuse early, with a clear line, a runs folder that cannot be created or written."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".multilane-write-test-{os.getpid()}"
        probe.write_bytes(b"x" * 4096)
        probe.unlink()
    except OSError as e:
        raise UserError(f"runs folder {folder}: not writable ({e.strerror or e})") from None


class RunDir:
    """Writes one run's folder; also used to reopen it for ``--resume``."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._metrics_fd: int | None = None
        self._lock = threading.Lock()

    @classmethod
    def create(cls, runs_dir: str | Path, name: str) -> RunDir:
        """A new ``<runs_dir>/<timestamp>-<name>/``; never one another run already took."""
        root = Path(runs_dir).expanduser()
        check_writable(root)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for i in range(1000):
            path = root / (f"{stamp}-{name}" if i == 0 else f"{stamp}-{name}-{i + 1}")
            try:
                path.mkdir()  # exclusive: two runs started in the same second get two folders
            except FileExistsError:
                continue
            except OSError as e:
                raise UserError(f"runs folder {root}: cannot create a run folder ({e.strerror or e})") from None
            (path / "checkpoints").mkdir()
            return cls(path)
        raise UserError(f"runs folder {root}: too many runs named {name!r} this second")

    @classmethod
    def open_existing(cls, path: str | Path) -> RunDir:
        p = Path(path).expanduser()
        if not p.is_dir():
            raise UserError(f"resume: {p} is not a run folder")
        if not (p / CHECKPOINT).is_file():
            raise UserError(f"resume: {p} has no checkpoint ({CHECKPOINT}) to resume from")
        return cls(p)

    # -- writing --------------------------------------------------------------------------------
    def write_json(self, name: str, data: dict[str, Any]) -> None:
        _atomic_write_bytes(self.path / name, (json.dumps(_json_safe(data), indent=2) + "\n").encode())

    def append_metric(self, record: dict[str, Any]) -> None:
        """Append one record; safe from several threads (training and telemetry)."""
        line = (json.dumps(_json_safe(record), separators=(",", ":")) + "\n").encode()
        with self._lock:
            if self._metrics_fd is None:
                self._metrics_fd = os.open(self.path / METRICS, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.write(self._metrics_fd, line)  # one write: a kill leaves whole lines only

    def set_status(self, state: str, message: str | None = None, **extra: Any) -> None:
        self.write_json(STATUS, {"state": state, "message": message, "updated": time.time(), **extra})

    def append_text(self, name: str, text: str) -> None:
        """Append ``text`` to a text file of the run (one write on an append-only file)."""
        with open(self.path / name, "ab") as f:
            f.write(text.encode("utf-8"))

    def write_error(self, text: str) -> None:
        (self.path / ERROR).write_text(text, encoding="utf-8")

    def save_checkpoint(self, state: dict[str, Any]) -> None:
        target = self.path / CHECKPOINT
        target.parent.mkdir(exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        torch.save(state, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, target)

    def close(self) -> None:
        with self._lock:
            if self._metrics_fd is not None:
                os.close(self._metrics_fd)
                self._metrics_fd = None

    # -- reading --------------------------------------------------------------------------------
    def load_checkpoint(self) -> dict[str, Any]:
        return load_checkpoint(self.path / CHECKPOINT)

    def read_json(self, name: str) -> dict[str, Any] | None:
        try:
            return json.loads((self.path / name).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            return None


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise UserError(f"checkpoint {path}: cannot load it ({type(e).__name__}: {e})") from None


def iter_metrics(path: str | Path) -> Iterator[dict[str, Any]]:
    """Every complete record of a metrics.jsonl, skipping a torn last line left by a kill."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return
    for raw in data.split(b"\n"):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
        except json.JSONDecodeError:
            continue  # only a kill mid-line can leave one, and only as the last line
        if isinstance(rec, dict):
            yield rec


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The run's records as they stand after resumes.

    When a run resumes from a checkpoint at step S, records it had logged past S (after that
    checkpoint, before the crash or stop) are superseded by the resumed run's own: they are dropped.
    So is the partial record a stop logs for its open log window (``"partial": true``): the
    checkpoint carries that window, and the resumed run logs it whole.
    """
    out: list[dict[str, Any]] = []
    for rec in iter_metrics(Path(run_dir) / METRICS):
        if rec.get("kind") == "event" and rec.get("resumed_from_step") is not None:
            s = rec["resumed_from_step"]
            out = [r for r in out if r.get("kind") in ("event", "telemetry") or not _superseded(r, s)]
        out.append(rec)
    return out


def _superseded(rec: dict[str, Any], resumed_from: int) -> bool:
    step = rec.get("step", 0)
    return step > resumed_from or (step == resumed_from and rec.get("partial") is True)
