"""A Multilane run folder for a training loop Multilane does not drive (Lightning, transformers).

The integrations' callbacks hand it what the outside trainer knows (each step's loss, the learning
rate, validation metrics) and it writes the run folder exactly as the engine does: ``RunDir`` (one
writer, its lock, whole records), the engine's record schema (every record passes ``record_problem``),
``status.json`` (its step kept current while training, as the engine's), the engine's telemetry
sampler, and the control file the app's Stop and Pause write.

Under ddp (``torch.distributed`` initialised, more than one process) rank 0 writes, as in the engine's
own ddp strategy. At each step every rank calls ``step_end`` together: one small ``all_gather`` carries
each rank's own loss (``device_loss``), whether a rank holds telemetry for rank 0, and rank 0's reading
of the control file, so every rank stops (or pauses) at the same step. Every rank knows the run folder:
a rank that fails writes its own failure note there (engine/distributed/failures.py, as the engine's
ddp ranks do), and rank 0 records the failure that caused the others, not its peers' "connection
closed".
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from multilane.engine.config import RunConfig
from multilane.engine.distributed.failures import consolidate, write_note
from multilane.engine.errors import UserError
from multilane.engine.run.callbacks import MetricsWriter, split_health
from multilane.engine.run.control import RunControl
from multilane.engine.rundir.control_file import ControlFile
from multilane.engine.rundir.runlog import CONFIG, ENVIRONMENT, RunDir, record_problem
from multilane.engine.telemetry.devices import Device
from multilane.engine.telemetry.envinfo import environment
from multilane.engine.telemetry.sampler import TelemetrySampler

NAME = re.compile(r"^[A-Za-z0-9._-]{1,80}$")  # as the engine's run.name
PAUSE_POLL_S = 0.2
# A rank that failed because another rank went away (gloo's "Connection closed by peer"): its own error
# is secondary (as engine/distributed/worker.py judges it).
LOST_PEERS = re.compile(r"Connection closed by peer|Connection reset|Broken pipe|DistNetworkError", re.I)
WAIT_FOR_CAUSE_S = 5.0  # rank 0, failed with "lost its peers": how long it waits for the cause's note


@dataclass
class StepEnd:
    """What every rank learns at the end of a step."""

    losses: dict[str, float]  # each rank's own loss, by device key (all of them on rank 0)
    stop: bool  # a Stop came: end training now
    samples: int | None  # the step's samples over every rank, where each rank counted its own


def _dist() -> Any:
    """``torch.distributed`` when this process is one rank of several, else None."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist
    return None


def device_of(device: torch.device | str, local_rank: int = 0) -> Device:
    """The engine's name for a torch device (``cpu`` is CPU lane ``local_rank``)."""
    d = torch.device(device)
    if d.type == "cuda":
        return Device("cuda", d.index if d.index is not None else torch.cuda.current_device())
    return Device("cpu", local_rank)


class RunRecorder:
    """Writes one outside trainer's run into ``<runs_dir>/<timestamp>-<name>/`` (on rank 0)."""

    def __init__(self, runs_dir: str | Path = "runs", name: str = "run", telemetry: bool = True) -> None:
        if not isinstance(name, str) or not NAME.match(name):
            raise UserError(f"run name {name!r}: use 1 to 80 letters, digits, '.', '_' or '-'")
        self.runs_dir = Path(runs_dir).expanduser()
        self.name = name
        self.telemetry = telemetry
        self.rd: RunDir | None = None
        self.control = RunControl()
        self.step = 0
        self.total_steps: int | None = None
        self.busy_s = 0.0  # this rank's time in steps: a CPU device's "utilization"
        self.stop_asked = False  # a Stop came through the control file
        self.key = "cpu:0"
        self.rank, self.world = 0, 1
        self._file: ControlFile | None = None
        self._sampler: TelemetrySampler | None = None
        self._rank_telemetry: Any = None
        self._open = False
        self._all_keys = [self.key]
        self._shared_dir: Path | None = None  # the run folder, on every rank (rank 0 made it)
        self._writer: MetricsWriter | None = None  # rank 0's: the loop's own writer of the run folder

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def run_dir(self) -> Path | None:
        return self.rd.path if self.rd is not None else None

    # -- start ----------------------------------------------------------------------------------
    def open(
        self,
        library: str,
        task: str,
        device: torch.device | str,
        total_steps: int | None = None,
        batch_size: int | None = None,
        optimizer: tuple[str, float] | None = None,
        extra: dict[str, Any] | None = None,
        health: dict[str, Any] | None = None,
        strategy: str | None = None,
    ) -> None:
        """Start the run: on rank 0 the folder, config.json, environment.json, status and "started";
        on every rank the telemetry of its own device. Under ddp a collective (every rank calls it).
        ``strategy``: config.json's ``devices.strategy`` (by default ``ddp`` over several processes,
        else ``single``)."""
        dist = _dist()
        local_rank = 0
        if dist is not None:
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
            local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        dev = device_of(device, local_rank)
        host = socket.gethostname()
        self.key = dev.name if dist is None else f"{host}/rank{self.rank}/{dev.name}"
        keys = [self.key]
        if dist is not None:
            keys = [None] * self.world
            dist.all_gather_object(keys, self.key)
        self._all_keys = [str(k) for k in keys]
        self.total_steps = total_steps if isinstance(total_steps, int) and total_steps > 0 else None
        if self.is_main:
            self.rd = RunDir.create(self.runs_dir, self.name)
            config: dict[str, Any] = {
                "task": {"name": f"{library}:{task}"},
                "devices": {"use": ",".join(keys), "strategy": strategy or ("ddp" if dist is not None else "single")},
                "run": {"name": self.name, "runs_dir": str(self.runs_dir)},
                "integration": {"library": library, **(extra or {})},
            }
            if batch_size:
                config["data"] = {"batch_size": batch_size}
            if optimizer is not None:
                config["optim"] = {"name": optimizer[0], "lr": optimizer[1]}
            if health is not None:
                config["health"] = health
            self.rd.write_json(CONFIG, config)
            self.rd.write_json(ENVIRONMENT, environment())
            self._file = ControlFile(self.rd.path)
            self.rd.set_status("running", step=self.step, total_steps=self.total_steps)
            self._writer = MetricsWriter(self.rd)
            self.event("started", total_steps=self.total_steps)
        self._shared_dir = self.rd.path if self.rd is not None else None
        if dist is not None:  # every rank learns the folder: a failing rank writes its note there
            where: list[Any] = [None] * self.world
            dist.all_gather_object(where, str(self._shared_dir) if self._shared_dir is not None else None)
            self._shared_dir = Path(where[0]) if where[0] else None
        self._open = True
        atexit.register(self._at_exit)
        if self.telemetry:
            self._start_telemetry(dev, host, local_rank, dist)

    def _start_telemetry(self, dev: Device, host: str, local_rank: int, dist: Any) -> None:
        busy = None if dev.is_cuda else (lambda: [self.busy_s])
        if dist is None:
            self._sampler = TelemetrySampler([dev], [self.key], self._telemetry, busy_seconds=busy)
        else:  # each rank samples its own device; the others' records travel to rank 0 in step_end
            from multilane.engine.distributed.rank import RankInfo, RankTelemetry

            info = RankInfo(self.rank, self.world, local_rank, self.world, host, dev)
            self._rank_telemetry = rt = RankTelemetry(info, lambda: self.step, self.write)
            self._sampler = rt.make_sampler(RunConfig())
            if self._sampler is not None and busy is not None:
                self._sampler.busy_seconds = busy
        if self._sampler is not None:
            self._sampler.start()

    def _telemetry(self, record: dict[str, Any]) -> None:
        self.write({**record, "step": self.step})

    # -- records --------------------------------------------------------------------------------
    def write(self, record: dict[str, Any]) -> None:
        """Append one record (rank 0; other ranks write nothing). A record the readers would skip is
        left out with a warning event naming why: watching a run must never end it."""
        if self.rd is None:
            return
        problem = record_problem(record)
        if problem is not None:
            kind = record.get("kind")
            record = {"kind": "event", "event": "warning", "step": self.step, "wall_time": time.time()}
            record["message"] = f"a {kind} record was left out of the run folder: {problem}"
        self.rd.append_metric(record)

    def event(self, name: str, **extra: Any) -> None:
        self.write({"kind": "event", "event": name, "step": self.step, "wall_time": time.time(), **extra})

    def train(self, step: int, loss: float, device_loss: dict[str, float] | None = None, **fields: Any) -> None:
        """A train record at ``step`` (rank 0): the loss, each device's own, and ``fields`` (lr, epoch,
        step_ms, ...; None values left out)."""
        self.step = step
        rec: dict[str, Any] = {"kind": "train", "step": step, "wall_time": time.time(), "loss": loss}
        if device_loss:
            rec["device_loss"] = device_loss
        rec.update({k: v for k, v in fields.items() if v is not None})
        self.write(rec)

    def health(self, record: dict[str, Any]) -> None:
        """A ``health`` record of the engine's monitor (rank 0): the grouped rows into metrics.jsonl,
        every layer's values into ``health_layers.jsonl``, as the engine's own runs write them."""
        rec = split_health(record)[0]
        if self._writer is not None and record_problem(rec) is None:
            self._writer.on_health(record)
        else:
            self.write(rec)  # a record the readers would skip: left out, a warning naming why

    def eval(self, step: int, val_loss: float | None, metrics: dict[str, float], **fields: Any) -> None:
        """A validation record at ``step`` (rank 0)."""
        rec: dict[str, Any] = {"kind": "eval", "step": step, "wall_time": time.time()}
        if val_loss is not None:
            rec["val_loss"] = val_loss
        rec["metrics"] = metrics
        rec.update({k: v for k, v in fields.items() if v is not None})
        self.write(rec)

    # -- between steps --------------------------------------------------------------------------
    def step_end(
        self, step: int, loss: float | None = None, step_s: float = 0.0, samples: int | None = None
    ) -> StepEnd:
        """Called by every rank after each optimizer step, with its own ``loss`` and ``samples``: rank 0
        learns every rank's loss (by device key) and the step's samples over all ranks; then Stop and
        Pause from the control file (Pause waits here, between steps)."""
        self.step = step
        self.busy_s += step_s
        losses: dict[str, float] = {} if loss is None else {self.key: loss}
        dist = _dist()
        stop, pause = self._read_control()
        if dist is not None:
            losses, stop, pause, samples = self._gather(dist, loss, stop, pause, samples)
        if pause and not stop:
            stop = self._paused(dist)
        if stop:
            self.stop_asked = True
        elif self._writer is not None:  # status.json's step current, as the engine keeps it
            self._writer.keep_status(step, self.total_steps)
        return StepEnd(losses, stop, samples)

    def _read_control(self) -> tuple[bool, bool]:
        if self._file is not None:
            self._file.apply(self.control)
        return self.control.stop_requested, self.control.pause_requested

    def _gather(
        self, dist: Any, loss: float | None, stop: bool, pause: bool, samples: int | None
    ) -> tuple[dict[str, float], bool, bool, int | None]:
        rt = self._rank_telemetry
        has_telemetry = rt is not None and not self.is_main and rt.overdue(0.0)
        mine = [math.nan if loss is None else float(loss), float(has_telemetry), float(stop), float(pause)]
        rows = _all_gather_rows(dist, [*mine, math.nan if samples is None else float(samples)])
        if any(r[1] for r in rows):  # some rank holds telemetry: one object gather brings it to rank 0
            held: list[Any] = [None] * self.world
            dist.all_gather_object(held, rt.take() if rt is not None else [])
            for records in held[1:] if self.is_main else ():
                for rec in records or ():
                    self.write(rec)
        losses = {k: r[0] for k, r in zip(self._all_keys, rows, strict=True) if not math.isnan(r[0])}
        counts = [r[4] for r in rows]
        total = None if any(math.isnan(c) for c in counts) else int(sum(counts))
        return losses, bool(rows[0][2]), bool(rows[0][3]), total

    def _paused(self, dist: Any) -> bool:
        """Wait while paused (every rank, together); True when a Stop came meanwhile."""
        if self.rd is not None:
            self.rd.set_status("paused", step=self.step, total_steps=self.total_steps)
        self.event("paused")
        stop = pause = False
        while True:
            self.control.wait_while_paused(PAUSE_POLL_S)
            stop, pause = self._read_control()
            if dist is not None:
                rows = _all_gather_rows(dist, [0.0, 0.0, float(stop), float(pause)])
                stop, pause = bool(rows[0][2]), bool(rows[0][3])
            if stop or not pause:
                break
        if not stop:
            if self.rd is not None:
                self.rd.set_status("running", step=self.step, total_steps=self.total_steps)
            self.event("resumed")
        return stop

    # -- end ------------------------------------------------------------------------------------
    def fail(self, exception: BaseException) -> None:
        """The outside trainer raised: the run ends ``failed`` with this rank's traceback (Ctrl+C: ``stopped``).
        Under ddp every rank writes its failure note in the run folder and rank 0 records the one that
        caused the others: a rank's own error, not its peers' "connection closed"."""
        if isinstance(exception, KeyboardInterrupt):
            self.finish("stopped", "interrupted")
            return
        import traceback as tb

        text = "".join(tb.format_exception(exception))
        message = f"{type(exception).__name__}: {exception}"[:500]
        if self.world == 1 or self._shared_dir is None:
            self.finish("failed", message, text)
            return
        lost = bool(LOST_PEERS.search(message))
        note = f"rank {self.rank} ({self.key}): {message}"
        with contextlib.suppress(OSError):  # a folder this node does not share: rank 0 says what it knows
            write_note(self._shared_dir, self.rank, note, text, lost, time.time())
        if not self.is_main:
            self.finish("failed")  # rank 0 writes the outcome
            return
        self.finish(None)  # closed without an outcome: consolidate writes the one that caused the rest
        try:
            consolidate(self._shared_dir, wait_for_cause_s=WAIT_FOR_CAUSE_S if lost else 0.0)
        except Exception:  # the notes cannot be read: this rank's own account, as one process would
            self._open = True
            self.rd = RunDir(self._shared_dir)
            self.finish("failed", message, text)

    def _at_exit(self) -> None:
        """The interpreter ends with the run still open (no end and no exception reached us): never "running"."""
        self.finish("failed", "the process ended while the run was training (no outcome was reported)")

    def finish(self, status: str | None, message: str | None = None, traceback: str | None = None) -> None:
        """Record the outcome (finished, stopped, failed; None: none, another writes it) and close the
        folder. Safe to call twice."""
        if not self._open:
            return
        self._open = False
        if self._sampler is not None:
            with contextlib.suppress(Exception):
                self._sampler.stop()
        if self.rd is None:
            return
        try:
            if status is None:
                return
            if traceback:
                self.rd.write_error(traceback)
            self.rd.set_status(status, message, step=self.step, total_steps=self.total_steps)
            self.event(status, **({"message": message} if message else {}))
        finally:
            self.rd.close()


def _all_gather_rows(dist: Any, row: list[float]) -> list[list[float]]:
    """Every rank's ``row`` (float64), in rank order, on the process group's own device."""
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    mine = torch.tensor(row, dtype=torch.float64, device=device)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [t.tolist() for t in out]
