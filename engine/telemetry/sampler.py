"""Live per-device telemetry, sampled in its own thread, independent of the training loop.

The sampler reads every ``1 / rate_hz`` seconds and emits one record every ``record_s`` seconds.
Rates (GPU utilization, power, a CPU lane's busy %, the process's CPU %) keep mean, min and max over
the record's interval; levels (memory, temperature, clock) keep the latest reading. A metric the
device does not give is absent, never 0.

NVML's utilization is a duty cycle over a 1/6 s to 1 s window: sampling much faster repeats values,
much slower aliases; 5 Hz is the default.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil
from multilane.engine.telemetry.devices import Device
from multilane.engine.telemetry.nvml import MB, NvmlReader, open_nvml

RATES = ("util_pct", "power_w", "busy_pct", "cpu_pct")


def _summary(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}


class TelemetrySampler:
    """Samples the run's devices and the process; hands each record to ``on_record``.

    ``busy_seconds`` returns each CPU lane's cumulative compute seconds (from the engine's own
    timing), or None before training starts. ``nvml`` is an NvmlReader, or None to open one where
    CUDA devices are used and NVML is present.
    """

    def __init__(
        self,
        devices: list[Device],
        lane_names: list[str],
        on_record: Callable[[dict[str, Any]], None],
        rate_hz: float = 5.0,
        record_s: float = 1.0,
        busy_seconds: Callable[[], list[float] | None] | None = None,
        nvml: NvmlReader | None = None,
        output_index: int = 0,
        warn_after_s: float = 20.0,
    ) -> None:
        self.devices = devices
        self.lane_names = lane_names
        self.on_record = on_record
        self.period = 1.0 / rate_hz
        self.record_s = record_s
        self.busy_seconds = busy_seconds
        self.output_name = devices[output_index].name
        self.cuda_indices = sorted({d.index for d in devices if d.is_cuda})
        self.nvml = nvml if nvml is not None else open_nvml(self.cuda_indices)
        self.process = psutil.Process()
        self.process.cpu_percent(None)  # prime: the first call has no interval to measure
        self._samples: list[dict[str, dict[str, float]]] = []
        self._last_busy: list[float] | None = None
        self._last_t = time.monotonic()
        self._energy_j: dict[str, float] = {}
        self._energy_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.warned: set[str] = set()
        # each device's load (busy or utilization %) integrated over the run: the imbalance warning
        # reads these, never one record (a step's work lands in whichever record it falls)
        self.warn_after_s = warn_after_s
        self._load: dict[str, float] = {}
        self._load_s: dict[str, float] = {}

    # -- the thread -----------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="multilane-telemetry", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop sampling and emit what the last, partial interval holds."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None
            if not self._samples:  # a run shorter than one sampling period still gets its one reading
                with contextlib.suppress(Exception):
                    self._samples.append(self.sample())
        if self._samples:
            self._emit()
        if self.nvml is not None:
            self.nvml.close()

    def _run(self) -> None:
        next_record = time.monotonic() + self.record_s
        while not self._stop.wait(self.period):
            try:
                self._samples.append(self.sample())
                if time.monotonic() >= next_record:
                    self._emit()
                    next_record += self.record_s
            except Exception:  # telemetry must never take the run down
                continue

    # -- one reading ----------------------------------------------------------------------------
    def sample(self) -> dict[str, dict[str, float]]:
        """One reading of every device and of the process."""
        now = time.monotonic()
        dt = max(now - self._last_t, 1e-9)
        self._last_t = now
        out: dict[str, dict[str, float]] = {}
        busy = self.busy_seconds() if self.busy_seconds else None
        if busy is not None:
            last = self._last_busy or [0.0] * len(busy)
            for name, d, b0, b1 in zip(self.lane_names, self.devices, last, busy, strict=True):
                if not d.is_cuda:
                    out[name] = {"busy_pct": min(100.0, 100.0 * (b1 - b0) / dt)}
            self._last_busy = list(busy)
        if self.cuda_indices:
            import torch

            for i in self.cuda_indices:
                name = f"cuda:{i}"
                reading = self.nvml.read(i) if self.nvml is not None else {}
                reading["torch_allocated_mb"] = torch.cuda.memory_allocated(i) / MB
                reading["torch_max_reserved_mb"] = torch.cuda.max_memory_reserved(i) / MB
                if "power_w" in reading:
                    with self._energy_lock:
                        self._energy_j[name] = self._energy_j.get(name, 0.0) + reading["power_w"] * dt
                out[name] = reading
        out["process"] = {"cpu_pct": self.process.cpu_percent(None), "rss_mb": self.process.memory_info().rss / MB}
        for name, reading in out.items():
            pct = reading.get("busy_pct", reading.get("util_pct"))
            if name != "process" and pct is not None:
                self._load[name] = self._load.get(name, 0.0) + pct * dt
                self._load_s[name] = self._load_s.get(name, 0.0) + dt
        return out

    def energy_j(self) -> float | None:
        """Energy the run's GPUs used so far (J), where they report power; None elsewhere."""
        with self._energy_lock:
            return sum(self._energy_j.values()) if self._energy_j else None

    # -- one record -----------------------------------------------------------------------------
    def _emit(self) -> None:
        samples, self._samples = self._samples, []
        record = aggregate(samples)
        with self._energy_lock:
            for name, joules in self._energy_j.items():
                record["devices"].setdefault(name, {})["energy_j"] = joules
        record.update(kind="telemetry", wall_time=time.time(), samples=len(samples))
        self.on_record(record)
        problem = self.nvml.problem if self.nvml is not None else None
        if problem and "driver" not in self.warned:  # said once; the run goes on without GPU readings
            self.warned.add("driver")
            self.on_record(
                {
                    "kind": "event",
                    "event": "warning",
                    "wall_time": time.time(),
                    "message": f"telemetry: {problem}; GPU readings stop for this run (training goes on)",
                }
            )
        for message in self.imbalance(record):
            self.on_record({"kind": "event", "event": "warning", "wall_time": time.time(), "message": message})

    def imbalance(self, record: dict[str, Any]) -> list[str]:
        """Warnings (each once a run) when the output device's memory runs well ahead of the
        others, or one device's load over the run so far lags the rest."""
        out = []
        devs = record["devices"]
        mem = {k: v["mem_used_mb"] for k, v in devs.items() if "mem_used_mb" in v}
        others = [v for k, v in mem.items() if k != self.output_name]
        if self.output_name in mem and others and "memory" not in self.warned:
            ahead, typical = mem[self.output_name], statistics.median(others)
            if ahead > 1.5 * typical and ahead - typical > 1024:
                self.warned.add("memory")
                out.append(
                    f"output device {self.output_name} uses {ahead:,.0f} MiB, the others about {typical:,.0f} MiB: "
                    "it holds the gathered outputs and the original model; give it a smaller share (the app's share column; devices.weights in a config)"
                )
        # The run's load so far, once every device has been watched warn_after_s: one record can hold
        # one lane's step and not the other's, and identical lanes read "0 % against 25 %".
        seen = [k for k in devs if k in self._load_s]
        if len(seen) > 1 and "busy" not in self.warned and min(self._load_s[k] for k in seen) >= self.warn_after_s:
            load = {k: self._load[k] / self._load_s[k] for k in seen}
            top = max(load.values())
            low_name, low = min(load.items(), key=lambda kv: kv[1])
            # well apart: on a busy shared CPU equal lanes differ by a third (25 % against 34 %)
            if top > 20 and low < 0.6 * top:
                self.warned.add("busy")
                out.append(
                    f"{low_name} has been busy {low:.0f}% of the time against {top:.0f}% on the busiest device: "
                    "an uneven split or a slower device; adjust its share (the app's share column; devices.weights in a config)"
                )
        return out


def aggregate(samples: list[dict[str, dict[str, float]]]) -> dict[str, Any]:
    """Fold raw samples into one record: rates as mean/min/max, levels as the latest value."""
    devices: dict[str, dict[str, Any]] = {}
    process: dict[str, Any] = {}
    keys: dict[str, set[str]] = {}
    for s in samples:
        for name, reading in s.items():
            keys.setdefault(name, set()).update(reading)
    for name, ks in keys.items():
        target = process if name == "process" else devices.setdefault(name, {})
        for k in sorted(ks):
            values = [s[name][k] for s in samples if name in s and k in s[name]]
            target[k] = _summary(values) if k in RATES else values[-1]
    return {"devices": devices, "process": process}


def live_readings(seconds: float = 0.5, problems: list[str] | None = None) -> list[dict[str, Any]]:
    """A one-off reading of every device this machine has (for ``multilane devices``). What could not be
    read (a GPU, a driver that does not answer) is left out and said in one line each in ``problems``."""
    from multilane.engine.telemetry.devices import describe_devices

    problems = [] if problems is None else problems
    rows = describe_devices(problems)
    cuda = [int(r["name"].split(":")[1]) for r in rows if r["kind"] == "cuda"]
    reader = open_nvml(cuda) if cuda else None
    per_cpu = psutil.cpu_percent(interval=seconds, percpu=True)
    vm = psutil.virtual_memory()
    for row in rows:
        if row["kind"] == "cuda":
            i = int(row["name"].split(":")[1])
            row.update(reader.read(i) if reader else {})
        else:
            row["util_pct"] = statistics.fmean(per_cpu) if per_cpu else None
            row["per_core_util_pct"] = per_cpu
            row["mem_used_mb"] = (vm.total - vm.available) / MB
    if reader:
        if reader.problem:
            problems.append(reader.problem)
        reader.close()
    return rows


def run_sampler(
    config: Any, devices: list[Device], backend: Any, emit: Callable[[dict], None]
) -> TelemetrySampler | None:
    """The sampler of a single-process run (``config.telemetry``), or None when telemetry is off."""
    t = config.telemetry
    if not t.enabled:
        return None
    return TelemetrySampler(
        devices,
        backend.lane_names,
        emit,
        rate_hz=t.rate_hz,
        record_s=t.record_s,
        busy_seconds=backend.lane_busy_seconds,
        output_index=config.devices.output,
    )
