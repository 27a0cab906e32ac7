"""The devices' line of a run: each device's utilization and memory, and the process's, from telemetry
records ("· cuda:0 97% 41.2 GiB · cuda:1 95% 38.0 GiB · rss 1.2 GiB"), as ``train``'s progress bar and
``watch`` show it."""

from __future__ import annotations

from typing import Any

from multilane.engine.numbers import format_percent


def format_telemetry(record: dict[str, Any]) -> str:
    """A short line of what each device is doing: "· cuda:0 97% 41.2 GiB · cuda:1 95% 38.0 GiB"."""
    parts = []
    for name, d in record.get("devices", {}).items():
        rate = d.get("util_pct") or d.get("busy_pct")
        text = name + (f" {format_percent(rate['mean'])}" if rate else "")
        if d.get("mem_used_mb") is not None:
            text += f" {d['mem_used_mb'] / 1024:.1f} GiB"
        parts.append(text)
    rss = record.get("process", {}).get("rss_mb")
    if rss is not None:
        parts.append(f"rss {rss / 1024:.1f} GiB")
    return "· " + " · ".join(parts) if parts else ""


class DeviceTelemetry:
    """Every device's latest telemetry, merged over the records: a ddp or fsdp run writes one record per rank,
    each naming its own device, so the line shows each rank's device, not the one sampled last."""

    def __init__(self) -> None:
        self.devices: dict[str, Any] = {}
        self.process: dict[str, Any] = {}

    def add(self, record: dict[str, Any]) -> str:
        """Fold one telemetry record in; the line of every device seen since the run (re)started."""
        self.devices.update(record.get("devices") or {})
        if record.get("process"):
            self.process = record["process"]  # the run's process: rank 0's where there are ranks
        return format_telemetry({"devices": self.devices, "process": self.process})

    def restart(self, lanes: Any) -> None:
        """A (re)start of the run: keep only the devices it trains on (a resume may use others)."""
        keep = set(lanes) if isinstance(lanes, list) else set()
        self.devices = {k: v for k, v in self.devices.items() if k in keep}
