"""Following a run another process is writing: incremental reads of metrics.jsonl and status.json.

``MetricsTail`` keeps a byte offset into metrics.jsonl and parses only what was appended since the
last read; a line still being written (no newline yet) waits for the next read. ``status.json`` is
re-read only when its stamp (inode, mtime, size) changes. The CLI's ``multilane watch`` uses
``RunFollower``; the app can poll one on a timer the same way.
"""

from __future__ import annotations

import json
import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from multilane.engine.rundir.readfile import NotRegularFile, kind_of, read_regular_file
from multilane.engine.rundir.records import CHUNK, MAX_LINE, is_int, parse_record
from multilane.engine.rundir.run_lock import writer_gone
from multilane.engine.rundir.runread import JSON_LIMIT, METRICS, STATUS

DIVERGED = "diverged"
"""The state of a run the engine ended because its loss (or weights) went non-finite: not a user's Stop."""
TERMINAL_STATES = ("finished", "stopped", "failed", "aborted", DIVERGED)
STATES = ("starting", "running", "paused", *TERMINAL_STATES)  # starting: set-up, its phase the message
WRITER_CHECK_S = 2.0  # how often a follower checks that a running run's writer still exists


class MetricsTail:
    """The records appended to one metrics.jsonl since the last ``read()``, read in chunks (a file of
    any size) and checked as every reader checks them (``records.py``): a bad line is skipped and
    counted in ``skipped``. ``NotRegularFile`` when the path is a folder, a FIFO or a device."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.offset = 0
        self.skipped = 0
        self._rest = b""  # an incomplete last line, kept until its newline arrives (at most MAX_LINE)
        self._too_long = False  # the line being read passed MAX_LINE: skipped up to its newline
        self._ino: int | None = None

    def read(self) -> list[dict[str, Any]]:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return []
        if not stat.S_ISREG(st.st_mode):  # never opened: a FIFO would block, a folder cannot be read
            raise NotRegularFile(f"{kind_of(st.st_mode)}, not a file")
        if st.st_ino != self._ino or st.st_size < self.offset:  # a new or truncated file: start over
            self._ino, self.offset, self._rest, self._too_long = st.st_ino, 0, b"", False
        if st.st_size == self.offset:
            return []
        out: list[dict[str, Any]] = []
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            return []
        try:
            while chunk := os.pread(fd, CHUNK, self.offset):
                self.offset += len(chunk)
                self._take(chunk, out)
        finally:
            os.close(fd)
        return out

    def _take(self, chunk: bytes, out: list[dict[str, Any]]) -> None:
        lines = chunk.split(b"\n")
        lines[0] = self._rest + lines[0]
        self._rest = lines.pop()  # b"" when the chunk ended with a newline
        if self._too_long:  # inside a line too long to keep (counted once): up to its newline
            if not lines:
                self._rest = b""
                return
            lines, self._too_long = lines[1:], False
        for raw in lines:
            if not raw.strip():
                continue
            rec = parse_record(raw)
            if rec is None:
                self.skipped += 1  # a torn line left by a kill, or damage
            else:
                out.append(rec)
        if len(self._rest) > MAX_LINE:  # no record is this long: drop it now, not after gigabytes
            self._rest, self._too_long = b"", True
            self.skipped += 1

    def skip_existing(self) -> None:
        """Start after what the file holds now (a resumed run: its earlier records are shown already)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return
        self._ino, self.offset, self._rest, self._too_long = st.st_ino, st.st_size, b"", False


def clean_status(data: Any) -> dict[str, Any] | None:
    """A status.json's content as readers may use it: None when it names no state; a field of the
    wrong type (a step "abc", a list for a message) is dropped, not passed on."""
    if not isinstance(data, dict) or data.get("state") not in STATES:
        return None
    out = dict(data)
    for key in ("step", "total_steps"):
        if out.get(key) is not None and not is_int(out[key]):
            del out[key]
    if out.get("message") is not None and not isinstance(out["message"], str):
        del out["message"]
    return out


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
        self.problem: str | None = None
        """Set when the folder cannot be followed (its metrics.jsonl or status.json is not a file)."""
        """Set when the run's writer is gone without a final status (``writer_gone``): nothing more comes."""
        self._checked = 0.0

    def skip_existing(self) -> None:
        """Report only what is written from now on: a resumed run's earlier records and its old
        (final) status are not the new process's."""
        self.metrics.skip_existing()
        self._status_stamp = self._stamp()

    def skip_status(self) -> None:
        """Ignore the status.json there now (a resumed run's old, final one) but read every record: a
        window that resumes a run shows its curves so far, and follows until the new process ends."""
        self._status_stamp = self._stamp()

    def _stamp(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.run_dir / STATUS)
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def poll(self) -> FollowUpdate:
        """New records and a changed status. A metrics.jsonl or status.json that is not a regular file
        (a folder, a FIFO) ends the follow with ``problem`` set: it is never opened or waited on."""
        try:
            update = FollowUpdate(records=self.metrics.read())
        except NotRegularFile as e:
            self.problem = f"{METRICS} is {str(e).split(',')[0]}; a run folder's {METRICS} must be a plain file"
            return FollowUpdate()
        path = self.run_dir / STATUS
        stamp = self._stamp()
        if stamp is not None and stamp != self._status_stamp:
            status = None
            try:
                status = clean_status(json.loads(read_regular_file(path, JSON_LIMIT)))
                self._status_stamp = stamp
            except NotRegularFile as e:
                self.problem = f"{STATUS} is {str(e).split(',')[0]}; a run folder's {STATUS} must be a plain file"
                return update
            except (ValueError, RecursionError):  # not JSON: damage, not a status (read again if it changes)
                self._status_stamp = stamp
            except OSError:
                pass  # replaced between stat and read: the next poll sees it
            if status is not None:
                self.status = status
                update.status = status
        now = time.monotonic()
        if self.check_writer and not self.done and now - self._checked >= WRITER_CHECK_S:
            self._checked = now
            # Asked before the status is looked at again: a writer that ended since this poll read
            # status.json wrote its final status first, and the next poll reads that, not "lost".
            gone = writer_gone(self.run_dir, status_written=stamp is not None)
            self.lost = gone if gone and self._stamp() == self._status_stamp else None
        return update

    @property
    def done(self) -> bool:
        return (
            self.problem is not None
            or self.lost is not None
            or (self.status is not None and self.status.get("state") in TERMINAL_STATES)
        )
