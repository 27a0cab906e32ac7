"""Telemetry: what the engine's NVML sampler records during a run, against nvidia-smi read at the same time.

A run of the built-in mlp task (bf16, wide enough to keep the GPU busy) trains for ~8 s with telemetry
on; a thread reads ``nvidia-smi --query-gpu`` every 0.5 s meanwhile. Each telemetry record of the run
(after the first, the warm-up) is compared with the nvidia-smi readings of its own second: utilization
and power as means, memory, temperature and SM clock as the nearest reading, the total memory and the
power limit exactly. torch's allocated and reserved memory must be there and fit inside what NVML
says is used, and the energy must be about the mean power times the time.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

from common import FAIL, INFO, PASS, SKIP, Context, Row
from environment import nvidia_smi

SMI_FIELDS = {
    "util_pct": "utilization.gpu",
    "mem_used_mb": "memory.used",
    "mem_total_mb": "memory.total",
    "temp_c": "temperature.gpu",
    "power_w": "power.draw",
    "power_limit_w": "power.limit",
    "sm_clock_mhz": "clocks.sm",
}
# NVML key -> (how close, what the row says): an absolute bound, or a relative one (a fraction).
BOUNDS: dict[str, tuple[str, float, str]] = {
    "util_pct": ("abs", 20.0, "within 20 points (both are 1/6-1 s averages)"),
    "mem_used_mb": ("abs", 1024.0, "within 1 GiB (read up to 0.25 s apart)"),
    "mem_total_mb": ("abs", 2.0, "equal (MiB)"),
    "temp_c": ("abs", 5.0, "within 5 C"),
    "power_w": ("rel", 0.25, "within 25%"),
    "power_limit_w": ("abs", 1.0, "within 1 W"),
    "sm_clock_mhz": ("rel", 0.2, "within 20%"),
}


class SmiPoller(threading.Thread):
    def __init__(self, period: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.period, self.readings, self._halt = period, [], threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            values = nvidia_smi(*SMI_FIELDS.values())
            if values is not None:
                self.readings.append((time.time(), dict(zip(SMI_FIELDS, values, strict=True))))
            self._halt.wait(self.period)

    def stop(self) -> None:
        self._halt.set()
        self.join(10)


def number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None  # "[N/A]", "[Not Supported]"


def train_with_telemetry(ctx: Context, seconds: float) -> tuple[str, list[dict[str, Any]]]:
    from multilane.engine import Trainer, TrainerCallback, build_config, make_task, read_metrics
    from multilane.engine.run.control import RunControl

    control = RunControl()
    stopper = threading.Timer(seconds, control.request_stop)  # the run's length in time, whatever a step costs
    big = not ctx.dry_run
    params = {"features": 1024, "width": 4096, "depth": 4, "samples": 32768} if big else {"samples": 2048}
    cfg = build_config(
        {
            "task": {"name": "mlp", "params": params},
            "devices": {"use": ctx.one},
            "data": {"batch_size": 8192 if big else 256, "val_fraction": 0.0},
            "train": {
                "steps": 100000,
                "precision": "bf16" if big else "fp32",
                "log_every": 5,
                "eval_every": 0,
                "checkpoint_minutes": 0,
            },
            "telemetry": {"enabled": True, "rate_hz": 5.0, "record_s": 1.0},
            "run": {"runs_dir": str(ctx.workdir / "runs")},
        }
    )

    class StartClock(TrainerCallback):
        def on_train_start(self, trainer: Any) -> None:
            stopper.start()

    trainer = Trainer(cfg, callbacks=[StartClock()], control=control, task=make_task("mlp", params))
    try:
        result = trainer.run()
    finally:
        stopper.cancel()
    return result.status, [r for r in read_metrics(result.run_dir) if r.get("kind") == "telemetry"]


def compare(key: str, ours: float, smi: float) -> bool:
    how, bound, _ = BOUNDS[key]
    return abs(ours - smi) <= (bound if how == "abs" else bound * max(abs(smi), 1e-9))


def run(ctx: Context) -> None:
    if nvidia_smi("name") is None:
        ctx.add(Row("telemetry", "nvidia-smi", "not found", "nvidia-smi on PATH", SKIP))
    poller = SmiPoller()
    poller.start()
    try:
        status, records = train_with_telemetry(ctx, seconds=8.0)
    finally:
        poller.stop()
    ctx.add(
        Row(
            "telemetry",
            "run with telemetry",
            f"{status}, {len(records)} records",
            "stopped, >= 4 records",
            PASS if status == "stopped" and len(records) >= 4 else FAIL,
        )
    )
    records = [r for r in records[1:] if "cuda:0" in r.get("devices", {})]
    if not records:
        ctx.add(Row("telemetry", "cuda:0 in the records", "absent", "present", FAIL))
        return
    pairs: dict[str, list[tuple[float, float]]] = {k: [] for k in SMI_FIELDS}
    missing: set[str] = set()
    for rec in records:
        dev = rec["devices"]["cuda:0"]
        t1 = rec["wall_time"]
        window = [r for t, r in poller.readings if t1 - 1.0 <= t <= t1]
        nearest = min(poller.readings, key=lambda tr: abs(tr[0] - t1), default=(0.0, {}))[1]
        for key in SMI_FIELDS:
            value = dev.get(key)
            value = value["mean"] if isinstance(value, dict) else value
            if key in ("util_pct", "power_w"):
                smi_values = [v for v in (number(r[key]) for r in window) if v is not None]
                smi = statistics.fmean(smi_values) if smi_values else None
            else:
                smi = number(nearest.get(key, ""))
            if smi is None:
                continue
            if value is None:
                missing.add(key)  # nvidia-smi reads it and the sampler left it out: a monitor hiding what is there
                continue
            pairs[key].append((float(value), smi))
    for key, values in pairs.items():
        expected = BOUNDS[key][2]
        if key in missing:
            ctx.add(Row("telemetry", key, "missing in the records", f"present ({SMI_FIELDS[key]} reads it)", FAIL))
        elif not values:
            ctx.add(Row("telemetry", key, "not read by either", expected, INFO))
        else:
            bad = [(a, b) for a, b in values if not compare(key, a, b)]
            ours, smi = statistics.fmean(a for a, _ in values), statistics.fmean(b for _, b in values)
            measured = f"NVML {ours:.1f}, nvidia-smi {smi:.1f} ({len(values)} records, {len(bad)} off)"
            ctx.add(Row("telemetry", key, measured, expected, FAIL if bad else PASS, {"pairs": values}))
    torch_memory_rows(ctx, records)


def torch_memory_rows(ctx: Context, records: list[dict[str, Any]]) -> None:
    last = records[-1]["devices"]["cuda:0"]
    alloc, reserved = last.get("torch_allocated_mb"), last.get("torch_max_reserved_mb")
    # The most NVML saw used: the last record may come after the run gave its cached memory back.
    used = max((r["devices"]["cuda:0"].get("mem_used_mb") or 0.0 for r in records), default=None) or None
    ok = alloc is not None and reserved is not None and 0 < alloc <= reserved and (used is None or reserved <= used + 1)
    ctx.add(
        Row(
            "telemetry",
            "torch allocated / max reserved (MB)",
            f"{alloc} / {reserved} (NVML used {used})",
            "0 < allocated <= reserved <= used",
            PASS if ok else FAIL,
        )
    )
    energy = last.get("energy_j")
    powers = [r["devices"]["cuda:0"]["power_w"]["mean"] for r in records if "power_w" in r["devices"]["cuda:0"]]
    if energy is None or not powers:
        ctx.add(Row("telemetry", "energy_j", str(energy), "present where power is read", FAIL if powers else INFO))
        return
    # The sampler integrates power from its start; the first record (dropped above) holds its first second.
    span = records[-1]["wall_time"] - records[0]["wall_time"] + 2.0
    expected_j = statistics.fmean(powers) * span
    ok = abs(energy - expected_j) <= 0.35 * expected_j
    ctx.add(
        Row(
            "telemetry",
            "energy_j",
            f"{energy:.0f} J",
            f"~ mean power x time = {expected_j:.0f} J (35%)",
            PASS if ok else FAIL,
        )
    )
