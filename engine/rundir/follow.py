"""Following a run another process is writing: incremental reads of metrics.jsonl and status.json.

``MetricsTail`` keeps a byte offset into metrics.jsonl and parses only what was appended since the
last read; a line still being written (no newline yet) waits for the next read. ``status.json`` is
re-read only when its stamp (inode, mtime, size) changes. The CLI's ``multilane watch`` uses
``RunFollower``; the app can poll one on a timer the same way.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from multilane.engine.rundir.run_lock import writer_gone
from multilane.engine.rundir.runlog import METRICS, STATUS

TERMINAL_STATES = ("finished", "stopped", "failed")
WRITER_CHECK_S = 2.0  # how often a follower checks that a running run's writer still exists


class MetricsTail:
    """The records appended to one metrics.jsonl since the last ``read()``."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.offset = 0
        self._rest = b""  # an incomplete last line, kept until its newline arrives
        self._ino: int | None = None

    def read(self) -> list[dict[str, Any]]:
        try:
            f = open(self.path, "rb")  # noqa: SIM115 (closed below)
        except FileNotFoundError:
            return []
        with f:
            st = os.fstat(f.fileno())
            if st.st_ino != self._ino or st.st_size < self.offset:  # a new or truncated file: start over
                self._ino, self.offset, self._rest = st.st_ino, 0, b""
            if st.st_size == self.offset:
                return []
            f.seek(self.offset)
            data = f.read(st.st_size - self.offset)
        self.offset += len(data)
        lines = (self._rest + data).split(b"\n")
        self._rest = lines.pop()  # b"" when the data ended with a newline
        out = []
        for raw in lines:
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw)
            except ValueError:
                continue  # a torn line left by a kill
            if isinstance(rec, dict):
                out.append(rec)
        return out

    def skip_existing(self) -> None:
        """Start after what the file holds now (a resumed run: its earlier records are shown already)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return
        self._ino, self.offset, self._rest = st.st_ino, st.st_size, b""


@dataclass
class FollowUpdate:
    records: list[dict[str, Any]] = field(default_factory=list)
    status: dict[str, Any] | None = None
    """The new status.json, when it changed since the last poll."""


class RunFollower:
    """Polls one run directory: new metrics records and status changes."""

    def __init__(self, run_dir: str | Path, check_writer: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.metrics = MetricsTail(self.run_dir / METRICS)
        self._status_stamp: tuple[int, int, int] | None = None
        self.status: dict[str, Any] | None = None
        self.check_writer = check_writer
        self.lost: str | None = None
        """Set when the run's writer is gone without a final status (``writer_gone``): nothing more comes."""
        self._checked = 0.0

    def skip_existing(self) -> None:
        """Report only what is written from now on: a resumed run's earlier records and its old
        (final) status are not the new process's."""
        self.metrics.skip_existing()
        self._status_stamp = self._stamp()

    def _stamp(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.run_dir / STATUS)
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def poll(self) -> FollowUpdate:
        update = FollowUpdate(records=self.metrics.read())
        path = self.run_dir / STATUS
        stamp = self._stamp()
        if stamp is not None and stamp != self._status_stamp:
            try:
                status = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                status = None  # replaced between stat and read: the next poll sees it
            if isinstance(status, dict):
                self._status_stamp, self.status = stamp, status
                update.status = status
        now = time.monotonic()
        if self.check_writer and not self.done and now - self._checked >= WRITER_CHECK_S:
            self._checked = now
            # (a status written since this poll read it is read by the next poll, not called lost)
            self.lost = writer_gone(self.run_dir) if self._stamp() == self._status_stamp else None
        return update

    @property
    def done(self) -> bool:
        return self.lost is not None or (self.status is not None and self.status.get("state") in TERMINAL_STATES)
