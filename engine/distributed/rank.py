"""Who this process is in a ddp run (from the environment torchrun and the elastic agent set) and its
process group: NCCL on GPUs, Gloo on the CPU, with a timeout so that a dead or hung rank ends the run."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from multilane.engine.config import RunConfig
from multilane.engine.errors import UserError
from multilane.engine.rundir.runlog import RunDir
from multilane.engine.telemetry.busy import BusyClock
from multilane.engine.telemetry.devices import Device, cuda_count, parse_devices
from multilane.engine.telemetry.sampler import TelemetrySampler


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world: int
    local_rank: int
    local_world: int
    host: str
    device: Device

    @property
    def key(self) -> str:
        """This rank's name in ``device_loss`` and telemetry: host, rank and device."""
        return f"{self.host}/rank{self.rank}/{self.device.name}"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, devices_spec: str) -> RankInfo:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ["LOCAL_RANK"])
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        return cls(rank, world, local_rank, local_world, socket.gethostname(), rank_device(devices_spec, local_rank))


def rank_device(spec: str, local_rank: int) -> Device:
    """The device of local rank ``local_rank``: the ``local_rank``-th of the node's device list
    (``auto``: GPU ``local_rank`` where there are GPUs, else CPU lane ``local_rank``)."""
    if spec.strip().lower() == "auto":
        return Device("cuda", local_rank) if cuda_count() > local_rank else Device("cpu", local_rank)
    devices = parse_devices(spec)
    if local_rank >= len(devices):
        raise UserError(
            f"devices: local rank {local_rank} has no device; {spec} lists {len(devices)} "
            "(give one device per process on each node)"
        )
    return devices[local_rank]


def process_group_backend(choice: str, devices_spec: str, device: Device) -> str:
    """The library of the process group for ``devices.ddp_backend = choice``: auto is NCCL on GPUs, except
    where the node's device list names one GPU twice (two ranks on one GPU, which NCCL refuses with
    "Duplicate GPU detected"), and Gloo on CPU lanes."""
    if choice != "auto":
        return choice
    if not device.is_cuda:
        return "gloo"
    # The spec as written (every rank has it; ``rank_device`` has checked it): "cuda" is "cuda:0".
    gpus = [
        s if ":" in s else f"{s}:0"
        for s in (p.strip().lower() for p in devices_spec.split(","))
        if s.startswith("cuda")
    ]
    return "gloo" if len(set(gpus)) < len(gpus) else "nccl"


def init_process_group(
    info: RankInfo, timeout_s: float, backend: str = "auto", devices_spec: str = "auto", host_tensors: bool = False
) -> None:
    """Join the run's process group (env:// from the launcher), on this rank's device. ``host_tensors``
    (fsdp's CPU offload: its gradients, and so grad clipping's norm, live in host memory): NCCL for
    CUDA tensors and Gloo for CPU ones in the same group, as torchtitan does."""
    if info.device.is_cuda:
        torch.cuda.set_device(info.device.index)
    backend = process_group_backend(backend, devices_spec, info.device)
    if backend == "nccl" and host_tensors:
        backend = "cpu:gloo,cuda:nccl"
    # NCCL binds its communicator to the device at once; Gloo takes CUDA tensors without it.
    kwargs = {"device_id": info.device.torch_device()} if backend == "nccl" else {}
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **kwargs)


def cpu_threads_per_rank(local_world: int) -> int:
    """Intra-op threads for a CPU rank: the node's cores shared among its ranks."""
    return max(1, (os.cpu_count() or 1) // max(1, local_world))


class NullRunDir(RunDir):
    """The run folder as seen by a rank other than 0: it knows the path (for the control file) and
    writes nothing."""

    writes = False

    def write_json(self, name: str, data: dict[str, Any]) -> None: ...
    def append_metric(self, record: dict[str, Any]) -> None: ...
    def append_text(self, name: str, text: str) -> None: ...
    def set_status(self, state: str, message: str | None = None, **extra: Any) -> None: ...
    def write_error(self, text: str) -> None: ...
    def save_checkpoint(self, state: dict[str, Any]) -> None: ...


class RankTelemetry:
    """Telemetry in a ddp run: each rank samples its own device; rank 0 writes every rank's records.

    Rank 0 writes its own records as they are sampled. The other ranks buffer theirs, and the buffer
    travels to rank 0 inside the log window's one gather (``Ddp.log``, ddp.py): no collective of its own.
    Only when a log window is long (slow steps, a large ``train.log_every``) and a record has waited
    ``TELEMETRY_LAG_S`` does a rank raise a flag in the per-step control all-reduce, and all ranks send
    their records to rank 0 at the next step: the app never shows another rank's device more than a
    couple of seconds late.
    """

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
