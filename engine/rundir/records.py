"""What a line of ``metrics.jsonl`` must be for a reader to use it, and reading the file line by line.

Every reader (export, Open run, ``multilane watch``, the app's Follow) parses a line with
``parse_record`` and keeps it only when ``record_problem`` finds nothing wrong with the fields readers
use: a hand-edited or damaged line (a string loss, telemetry devices as a list, a warning without a
message, ``NaN`` literals) is skipped and counted, never passed on to crash a formatter or a plot.
``NaN``/``Infinity`` literals and numbers past a float's range read as null, as the writer writes a
non-finite value. ``iter_lines`` streams a file in chunks, so an 8 GiB file (or a sparse one with no
newline at all) never has to fit in memory.
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from multilane.engine.rundir.readfile import NotRegularFile, kind_of

BIG = 2**53  # steps and times beyond this are not a run's (and lose precision as floats)
MAX_LINE = 16 << 20  # a record is a few KiB; a longer "line" is damage, skipped without being held whole
CHUNK = 1 << 20
RATES = ("util_pct", "busy_pct", "cpu_pct")  # telemetry readings summarised as {"mean", "min", "max"}
_NUMBERS = {
    "train": ("loss", "epoch", "lr", "samples_per_s", "step_ms", "grad_norm"),
    "eval": ("val_loss",),
}


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < BIG


def is_num(v: Any) -> bool:
    return isinstance(v, float) or (isinstance(v, int) and not isinstance(v, bool) and abs(v) < BIG)


def _num_or_null(v: Any) -> bool:
    return v is None or is_num(v)


def _table_of_numbers(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and _num_or_null(x) for k, x in v.items())


def _reading_problem(name: str, reading: Any) -> str | None:
    """A telemetry reading: a device's (or the process's) fields, each a number or a summary table."""
    if not isinstance(reading, dict):
        return f"{name} not an object"
    for key, value in reading.items():
        if key in RATES:
            if not (_table_of_numbers(value) and is_num(value.get("mean"))):
                return f"{name}.{key} not a summary of numbers"
        elif not (_num_or_null(value) or _table_of_numbers(value)):
            return f"{name}.{key} not a number"
    return None


HEALTH_ROWS = {"rows": ("grad_norm", "weight_norm", "update_ratio"), "act_rows": ("act_mean", "act_std", "act_zero")}
READINGS = ("util_pct", "busy_pct", "mem_used_mb", "torch_allocated_mb", "power_w", "temp_c", "cpu_pct", "rss_mb")
"""The telemetry readings (a device's and the process's) the integrations export as metrics."""


def _health_problem(rec: dict[str, Any]) -> str | None:
    """A ``health`` record: row names, and per quantity one number (or null) per row."""
    for rows_key, fields in HEALTH_ROWS.items():
        rows = rec.get(rows_key)
        if rows is None:
            if any(rec.get(f) is not None for f in fields):
                return f"{rows_key} missing"
            continue
        if not isinstance(rows, list) or not all(isinstance(r, str) for r in rows):
            return f"{rows_key} not a list of names"
        for f in fields:
            v = rec.get(f)
            if v is None:
                continue
            if not isinstance(v, list) or len(v) != len(rows) or not all(_num_or_null(x) for x in v):
                return f"{f} not one number per row"
    return None


def _noise_problem(noise: Any) -> str | None:
    if not isinstance(noise, dict):
        return "noise not an object"
    for key, v in noise.items():
        if key == "unit":
            if not isinstance(v, str):
                return "noise.unit not text"
        elif not _num_or_null(v):
            return f"noise.{key} not a number"
    return None


def record_problem(rec: Any) -> str | None:
    """Why a parsed line is not a record readers can use, or None."""
    if not isinstance(rec, dict):
        return "not an object"
    kind = rec.get("kind")
    if not isinstance(kind, str):
        return "no kind"
    step = rec.get("step")
    if kind in ("train", "eval") and not is_int(step):
        return "no whole step"
    if step is not None and not is_int(step):
        return "step not a whole number"
    if rec.get("wall_time") is not None and not is_num(rec["wall_time"]):
        return "wall_time not a number"
    for key in ("resumed_from_step", "total_steps"):
        if rec.get(key) is not None and not is_int(rec[key]):
            return f"{key} not a whole number"
    if kind == "event" and not isinstance(rec.get("event"), str):
        return "event without a name"
    if kind == "event" and rec.get("event") == "warning" and not isinstance(rec.get("message"), str):
        return "warning without a message"
    if rec.get("message") is not None and not isinstance(rec["message"], str):
        return "message not text"
    for key in _NUMBERS.get(kind, ()):
        if not _num_or_null(rec.get(key)):
            return f"{key} not a number"
    if rec.get("sample") is not None and not isinstance(rec["sample"], str):
        return "sample not text"
    if kind == "health" and (problem := _health_problem(rec)):
        return problem
    if rec.get("noise") is not None and (problem := _noise_problem(rec["noise"])):
        return problem
    for key in ("device_loss", "metrics", "phase_ms", "lane_busy_s"):
        if rec.get(key) is not None and not _table_of_numbers(rec[key]):
            return f"{key} not an object of numbers"
    for key in ("process", "devices"):
        if rec.get(key) is not None and not isinstance(rec[key], dict):
            return f"{key} not an object"
    if rec.get("process") is not None and (problem := _reading_problem("process", rec["process"])):
        return problem
    for name, reading in (rec.get("devices") or {}).items():
        if problem := _reading_problem(f"devices.{name}", reading):
            return problem
    return None


def metric_value(v: Any) -> float | None:
    """A record's value as a float (a per-lane table's mean); None when it is no finite number."""
    if isinstance(v, dict):
        v = v.get("mean")
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def _finite(text: str) -> float | None:
    v = float(text)
    return v if math.isfinite(v) else None


def parse_record(raw: bytes) -> dict[str, Any] | None:
    """The record on one line, or None when it is not one readers can use."""
    try:
        rec = json.loads(raw, parse_constant=lambda _: None, parse_float=_finite)
    except (ValueError, RecursionError):  # torn, not UTF-8, too deep, a 5,000-digit number
        return None
    return rec if record_problem(rec) is None else None


def iter_lines(path: str | Path) -> Iterator[bytes]:
    """Each line of a regular file, read in chunks. A line longer than ``MAX_LINE`` comes back as a NUL
    byte (damage: the reader skips it) without being held. ``NotRegularFile`` for a folder, a FIFO or a
    device."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO opens at once instead of waiting for a writer
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFile(f"{kind_of(mode)}, not a file")
        pos, rest, too_long = 0, b"", False
        while True:
            chunk = os.pread(fd, CHUNK, pos)
            if not chunk:
                if rest or too_long:
                    yield b"\0" if too_long else rest
                return
            start = 0
            while True:
                nl = chunk.find(b"\n", start)
                if nl < 0:
                    break
                line = rest + chunk[start:nl]
                rest, start = b"", nl + 1
                yield b"\0" if too_long else line
                too_long = False
            pos += len(chunk)
            if not too_long:
                rest += chunk[start:]
                if len(rest) > MAX_LINE:
                    rest, too_long = b"", True
    finally:
        os.close(fd)
