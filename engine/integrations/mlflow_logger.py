"""What sends a run to MLflow, each through a ``Sender`` (``multilane.integrations.mlflow``, imported only
when something is sent, so this module loads without the extra): ``MlflowLogger``, the trainer's callback
(live); ``MirrorLogger``, the mirror of a run on a host that cannot reach the server; ``export_run``, a run
folder sent later (``multilane export RUN --mlflow URI``).

A run on a host (``train --host``) logs from the host. The host that has not once reached the server
within ``HAND_OVER_S`` of its start (or by the run's end) hands the sending over: it writes a warning
event carrying ``mlflow_mirror`` (the server's URI) into metrics.jsonl and sends nothing more. The
mirror on the launching machine reads the records it copies in order: from that event on, until the
next ``started`` event (a resume: the host's new process tries again), it sends. It starts by reading
back what the server holds of every point so far (the host may have sent some), so no point is sent
twice and none is lost; then each new record, the artifacts and the end state. One sender at a time,
and the hand-over is a record both sides read in the same order.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from multilane.engine.errors import UserError
from multilane.engine.run.callbacks import RunResult, TrainerCallback
from multilane.engine.rundir.follow import TERMINAL_STATES
from multilane.engine.rundir.records import parse_record
from multilane.engine.rundir.runread import CONFIG, ENVIRONMENT, METRICS, STATUS, load_metrics, read_json
from multilane.integrations import mlflow_records as mr

if TYPE_CHECKING:
    from multilane.integrations.mlflow import Sender

POLL_S = 1.0  # the mirror reads its new records at most this often


def _tags(run_dir: Path, config: dict[str, Any], lanes: Any) -> dict[str, str]:
    env = read_json(run_dir / ENVIRONMENT) or {}
    host, version = (v if isinstance(v, str) else None for v in (env.get("hostname"), env.get("multilane")))
    return mr.run_tags(run_dir, config, lanes if isinstance(lanes, list) else None, host, version)


def _experiment(config: dict[str, Any]) -> str:
    return str((config.get("tracking") or {}).get("experiment") or "multilane")


# -- live, from the trainer -----------------------------------------------------------------------------------------
class MlflowLogger(TrainerCallback):
    """Logs a run live to ``uri`` (rank 0 only under ddp/fsdp: the trainer attaches it where the run
    folder is written). Hooks only queue: the sending is the ``Sender``'s thread's."""

    def __init__(
        self, uri: str, experiment: str, run_dir: Path, config: dict[str, Any], hand_over: bool | None = None
    ) -> None:
        self.uri, self.experiment, self.run_dir, self.config = uri, experiment, Path(run_dir), config
        # started on a host by ``train --host`` (engine/remote/launch.py): a server this host does not reach
        # is handed to the mirror on the launching machine (``MirrorLogger``)
        self.hand_over = os.environ.get(mr.MIRROR_ENV) == "1" if hand_over is None else hand_over
        self._handed: str | None = None
        self.points = mr.PointMaker()
        self.sender: Sender | None = None
        self._event: Callable[..., None] | None = None  # the run's events (``on_train_start``)
        self._warning: str | None = None
        self._warned = False
        self._lock = threading.Lock()

    def _problem(self, words: str, lasting: bool = False) -> None:
        """The one warning of the run: a server that fails now (the records wait for it) or a URI that
        can never work (nothing is sent); both name the export that sends the run later."""
        then = "nothing is sent" if lasting else "training goes on, the records wait for the server"
        with self._lock:
            if not self._warned:
                self._warning = (
                    f"mlflow: {mr.public_uri(self.uri)}: {words}; {then} (or later: multilane export RUN --mlflow URI)"
                )

    def _handed_over(self, why: str) -> None:
        with self._lock:
            self._handed = (
                f"mlflow: {mr.public_uri(self.uri)}: {why} from {socket.gethostname()}; the mirror on the launching"
                " machine sends the run (or later: multilane export MIRROR --mlflow URI)"
            )

    def _say_warning(self) -> None:
        with self._lock:
            message, self._warning = self._warning, None
            if message:
                self._warned = True
            handed, self._handed = self._handed, None
        if self._event is None:
            return
        if message:
            self._event("warning", message=message)
        if handed:  # the record the mirror takes over from (``MirrorLogger``)
            self._event("warning", message=handed, **{mr.HAND_OVER_FIELD: mr.public_uri(self.uri)})

    def on_train_start(self, trainer: Any) -> None:
        self._event = trainer._event  # its one use of the loop: a warning is one of the run's events

    def on_event(self, record: dict[str, Any]) -> None:
        if record.get("event") == "started" and self.sender is None:
            first = mr.first_started(self.run_dir)
            key = mr.run_key(self.run_dir, first if first is not None else float(record["wall_time"]))
            tags = mr.run_tags(self.run_dir, self.config, record.get("lanes"), None)
            hand = {"hand_over_s": mr.HAND_OVER_S, "on_hand_over": self._handed_over} if self.hand_over else {}
            from multilane.integrations.mlflow import Sender

            self.sender = Sender(self.uri, self.experiment, self.run_dir, key, tags, self._problem, **hand)
            self.sender.add(params=mr.flat_params(self.config))
            problem = mr.uri_problem(self.uri)
            if problem:  # said at once; nothing will be sent
                self._problem(problem, lasting=True)
            else:
                self.sender.start()
        elif record.get("event") in TERMINAL_STATES:  # the run's end, while its folder still takes records
            self._end(record["event"], record.get("wall_time"))
        self._say_warning()

    def _queue(self, record: dict[str, Any]) -> None:
        if self.sender is not None:
            self.sender.add(self.points.points(record))

    def on_log(self, record: dict[str, Any]) -> None:
        self._queue(record)
        self._say_warning()

    on_eval = on_log
    on_telemetry = _queue

    def _end(self, state: str, wall_time: Any) -> None:
        """Send the rest, the artifacts and the end state (at most ``END_WAIT_S``; a server still down gets
        one more try, then the export is the way)."""
        s, self.sender = self.sender, None
        if s is None or mr.uri_problem(self.uri) is not None:
            return
        end_ms = round(wall_time * 1000) if isinstance(wall_time, float) else round(time.time() * 1000)
        s.finish(mr.end_status(state), end_ms, mr.artifacts(self.run_dir), True)
        s.close()  # at most the sender's END_WAIT_S

    def on_train_end(self, result: RunResult) -> None:
        self._end(result.status, None)  # where the end event could not be given
        with self._lock:
            message = self._warning if not self._warned else None
        if message:  # met after the end event: the run folder is closed, the terminal is not
            print(f"multilane: warning: {message}", file=sys.stderr, flush=True)


# -- a run folder, sent: export ---------------------------------------------------------------------
def export_run(run_dir: Path, uri: str) -> str:
    """Send ``run_dir``'s records so far to ``uri`` (the same MLflow run on every send; only the points
    the server lacks); a line saying where they went. ``UserError`` (one line) where the server fails."""
    from multilane.integrations.mlflow import Sender

    problem = mr.uri_problem(uri)
    if problem:
        raise UserError(f"export: --mlflow {mr.public_uri(uri)}: {problem}")
    config = read_json(run_dir / CONFIG) or {}
    records = load_metrics(run_dir).records
    started = next((r for r in records if r.get("kind") == "event" and r.get("event") == "started"), None)
    if started is None or not isinstance(started.get("wall_time"), float):
        raise UserError(f"export: {run_dir} has no started event in its metrics.jsonl: nothing to send")
    tags = _tags(run_dir, config, started.get("lanes"))
    s = Sender(uri, _experiment(config), run_dir, mr.run_key(run_dir, started["wall_time"]), tags, live=False)
    maker = mr.PointMaker()
    points = [p for r in records for p in maker.points(r)]
    status = (read_json(run_dir / STATUS) or {}).get("state")
    try:
        run_id = s.ensure_run()
        points = mr.missing_points(s.client(), run_id, points)
        s.add(points, params=mr.flat_params(config))
        if status in ("finished", "failed", "stopped", "aborted"):
            end_ms = int(max((r.get("wall_time") or 0) for r in records) * 1000)
            s.finish(mr.end_status(status), end_ms, mr.artifacts(run_dir), True)
        s.send_now()
    except UserError as e:
        raise UserError(f"export: --mlflow {mr.public_uri(uri)}: {e}") from None
    except Exception as e:
        raise UserError(f"export: --mlflow {mr.public_uri(uri)}: {mr.reason(e)}") from None
    return f"mlflow: {len(points)} new points sent to run {run_id} at {mr.public_uri(uri)}"


class MirrorLogger:
    """The mirror's side of the hand-over: ``poll()`` (cheap, no network: the sending is a ``Sender``'s
    thread's) after each copy, ``close()`` at the follow's end, ``warnings`` for the follower to show."""

    def __init__(self, mirror_dir: Path) -> None:
        self.dir = Path(mirror_dir)
        self.offset = 0  # bytes of metrics.jsonl read
        self.owner = False  # the mirror sends this part of the run (from a hand-over to the next start)
        self.sender: Any = None
        self.maker = mr.PointMaker()
        self.warnings: list[str] = []
        self._first_started: float | None = None
        self._lanes: Any = None
        self._end: tuple[str, Any] | None = None  # this part's end (a hand-over may come after it)
        self._uri = ""
        self._broken = False
        self._next = 0.0

    def poll(self, force: bool = False) -> None:
        now = time.monotonic()
        if self._broken or (not force and now < self._next):
            return
        self._next = now + POLL_S
        try:
            self._read()
        except Exception as e:  # never the follow's end: one line, and the export is the way left
            self._broken = True
            self._problem(f"{type(e).__name__}: {e}")

    def _read(self) -> None:
        path = self.dir / METRICS
        try:
            size = path.stat().st_size
        except OSError:
            return
        if size <= self.offset:
            return
        with open(path, "rb") as f:
            f.seek(self.offset)
            data = f.read(size - self.offset)
        whole = data.rfind(b"\n") + 1  # whole lines only: a line still being copied waits
        at = self.offset
        self.offset += whole
        for line in data[:whole].splitlines(keepends=True):
            at += len(line)
            cheap = self.sender is None and b'"started"' not in line and mr.HAND_OVER_FIELD.encode() not in line
            if cheap and b'"event"' not in line:  # before any hand-over only the events matter
                continue
            rec = parse_record(line)
            if rec is not None:
                self._record(rec, at)

    def _record(self, rec: dict[str, Any], at: int) -> None:
        event = rec.get("event") if rec.get("kind") == "event" else None
        if event == "started":
            if self._first_started is None and isinstance(rec.get("wall_time"), float):
                self._first_started, self._lanes = rec["wall_time"], rec.get("lanes")
            self.owner, self._end = False, None  # a new process on the host: it tries the server itself
            return
        if event in TERMINAL_STATES:
            self._end = (event, rec.get("wall_time"))
        if event == "warning" and rec.get(mr.HAND_OVER_FIELD):
            self._take_over(at)
        elif self.owner and self.sender is not None:
            self.sender.add(self.maker.points(rec))
        if self.owner and self._end is not None and self.sender is not None:
            state, wall = self._end
            end_ms = round(wall * 1000) if isinstance(wall, float) else round(time.time() * 1000)
            self.sender.finish(mr.end_status(state), end_ms, mr.artifacts(self.dir), True)
            self._end = None

    def _take_over(self, upto: int) -> None:
        """Every point of the records so far, sent where the server lacks it, then each new one."""
        config = read_json(self.dir / CONFIG) or {}
        uri = (config.get("tracking") or {}).get("mlflow")
        if not isinstance(uri, str) or self._first_started is None or mr.uri_problem(uri):
            return
        self._uri = mr.public_uri(uri)
        if self.sender is None:
            try:
                from multilane.integrations.mlflow import Sender
            except ImportError as e:  # the extra is not installed on this machine: one line, nothing sent
                if not self.warnings:
                    self._problem(str(e))
                return
            key = mr.run_key(self.dir, self._first_started)
            tags = _tags(self.dir, config, self._lanes)
            live = (read_json(self.dir / STATUS) or {}).get("state") not in TERMINAL_STATES  # else: leave its end
            self.sender = Sender(uri, _experiment(config), self.dir, key, tags, self._problem, live=live)
            self.sender.add(params=mr.flat_params(config))
            self.sender.start()
        self.maker = mr.PointMaker()
        with open(self.dir / METRICS, "rb") as f:
            head = f.read(upto)
        points = []
        for line in head.splitlines():
            rec = parse_record(line)
            if rec is not None:
                points += self.maker.points(rec)
        self.sender.add(check=points)
        self.owner = True

    def _problem(self, words: str) -> None:
        self.warnings.append(  # the host could not send either: the export is the way left
            f"mlflow{': ' + self._uri if self._uri else ''}: the mirror here cannot send the host's records either: {words}"
            f" (later: multilane export {self.dir} --mlflow URI)"
        )

    def close(self, timeout: float) -> bool:
        """The last records read, then at most ``timeout`` to send the rest; whether all was sent."""
        self.poll(force=True)
        return self.sender.close(timeout) if self.sender is not None else True
