"""Telemetry in a ddp run: each rank samples its own device; rank 0 writes every rank's records.

Rank 0 writes its own records as they are sampled. The other ranks buffer theirs, and the buffer
travels to rank 0 inside the log window's one gather (``DdpTrainer._log``): no collective of its own.
Only when a log window is long (slow steps, a large ``train.log_every``) and a record has waited
``TELEMETRY_LAG_S`` does a rank raise a flag in the per-step control all-reduce, and all ranks send
their records to rank 0 at the next step: the app never shows another rank's device more than a
couple of seconds late.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from multilane.engine.config import RunConfig
from multilane.engine.distributed.rank import RankInfo
from multilane.engine.telemetry.busy import BusyClock
from multilane.engine.telemetry.sampler import TelemetrySampler


class RankTelemetry:
    def __init__(self, info: RankInfo, step: Callable[[], int], dispatch: Callable[[dict[str, Any]], None]) -> None:
        self.info, self._step, self._dispatch = info, step, dispatch
        self._lock = threading.Lock()
        self._buffer: list[dict[str, Any]] = []
        self.busy = BusyClock(1)  # this rank's compute time (a CPU rank's "utilization")

    def make_sampler(self, config: RunConfig) -> TelemetrySampler | None:
        t = config.telemetry
        if not t.enabled:
            return None
        cpu = not self.info.device.is_cuda
        return TelemetrySampler(
            [self.info.device],
            [self.info.key],
            self.on_record,
            rate_hz=t.rate_hz,
            record_s=t.record_s,
            busy_seconds=self.busy.seconds if cpu else None,
        )

    def on_record(self, record: dict[str, Any]) -> None:
        """A record from this rank's sampler (its thread): keyed by the rank, written or buffered."""
        info = self.info
        record = {**record, "step": self._step(), "host": info.host, "rank": info.rank}
        if record["kind"] == "telemetry":
            devices = record["devices"]
            entry = next(iter(devices.values()), {}) if devices else {}
            process = record.get("process", {})
            entry = {**entry, **{k: v for k, v in process.items() if k in ("cpu_pct", "rss_mb")}}
            record["devices"] = {info.key: entry}
            if not info.is_main:
                record.pop("process", None)  # the run's "process" series is rank 0's
        if info.is_main:
            self._dispatch(record)
        else:
            with self._lock:
                self._buffer.append(record)

    def overdue(self, lag_s: float) -> bool:
        """Whether a buffered record has waited longer than ``lag_s`` seconds."""
        with self._lock:
            return bool(self._buffer) and time.time() - self._buffer[0].get("wall_time", time.time()) > lag_s

    def take(self) -> list[dict[str, Any]]:
        """The records buffered since the last log window (a rank other than 0)."""
        with self._lock:
            out, self._buffer = self._buffer, []
        return out
