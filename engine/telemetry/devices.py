"""Which devices a run uses: parsing ``--devices`` and listing what this machine has."""

from __future__ import annotations

import glob
import os
import re
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from multilane.engine.errors import UserError
from multilane.engine.telemetry.driver import bounded, driver_problem

if TYPE_CHECKING:
    import torch

MAX_CPU_LANES = 64
# The device nodes without which no process of this machine can reach a GPU: NVIDIA's (/dev/nvidia0...),
# ROCm's (/dev/kfd, which torch.cuda serves on a ROCm build) and WSL2's (/dev/dxg).
GPU_NODES = ("/dev/nvidia[0-9]*", "/dev/kfd", "/dev/dxg")
_DEVICE_RE = re.compile(r"^(cpu|cuda)(?::(\d+))?$")


@dataclass(frozen=True)
class Device:
    """One device a replica runs on: a CUDA GPU, or a CPU lane (a virtual device, one thread)."""

    kind: str  # "cuda" or "cpu"
    index: int

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.index}"

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    def torch_device(self) -> torch.device:
        """Where this lane's tensors live (every CPU lane lives in the one CPU memory)."""
        import torch

        return torch.device("cuda", self.index) if self.is_cuda else torch.device("cpu")

    def __str__(self) -> str:
        return self.name


def _cuda_count() -> int:
    if sys.platform == "linux" and not any(glob.glob(pattern) for pattern in GPU_NODES):
        return 0  # no GPU's device node: torch.cuda would say 0 too, after ~2 CPU-seconds of ``import torch``
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def cuda_count() -> int:
    """How many CUDA GPUs torch sees; ``DriverNotAnswering`` (one line) when the driver does not answer
    in ``driver.TIMEOUT_S`` seconds."""
    return bounded(_cuda_count, what="the NVIDIA driver (CUDA)")


def cuda_properties(i: int) -> Any:
    """torch's properties of ``cuda:i``, bounded in time; ``UserError`` in one line when CUDA lists the
    GPU but cannot read them (a GPU fallen off the bus, a driver and CUDA that disagree)."""
    import torch

    try:
        return bounded(torch.cuda.get_device_properties, i, what="the NVIDIA driver (CUDA)")
    except UserError:
        raise
    except Exception as e:
        reason = " ".join(str(e).split())[:200] or type(e).__name__
        raise UserError(f"cuda:{i}: CUDA lists this GPU but cannot read its properties ({reason})") from None


def default_devices() -> list[Device]:
    """``auto``: every GPU; without one, two CPU lanes."""
    n = cuda_count()
    if n:
        return [Device("cuda", i) for i in range(n)]
    return [Device("cpu", 0), Device("cpu", 1)]


def parse_devices(spec: str | list[str] | None) -> list[Device]:
    """Parse ``auto``, ``cuda:0,cuda:1`` or ``cpu:0,cpu:1`` into devices, or raise UserError saying why.

    A repeated GPU (``cuda:0,cuda:0``) is valid: two replicas on one GPU. CPU lanes are numbered
    virtual devices, so each lane name may appear once.
    """
    if spec is None:
        return default_devices()
    items = spec if isinstance(spec, list) else str(spec).split(",")
    items = [str(s).strip().lower() for s in items]
    if items == ["auto"]:
        return default_devices()
    if not items or items == [""]:
        raise UserError("devices: the list is empty; give e.g. cpu:0,cpu:1, cuda:0,cuda:1 or auto")
    devices: list[Device] = []
    for item in items:
        m = _DEVICE_RE.match(item)
        if not m:
            raise UserError(f"devices: {item!r} is not a device; use cuda:N, cpu:N or auto (e.g. cuda:0,cuda:1)")
        devices.append(Device(m.group(1), int(m.group(2) or 0)))
    kinds = {d.kind for d in devices}
    if len(kinds) > 1:
        raise UserError("devices: do not mix cpu and cuda devices in one run")
    if "cpu" in kinds:
        names = [d.name for d in devices]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup:
            raise UserError(f"devices: CPU lane {dup} is listed twice; number the lanes cpu:0,cpu:1,...")
        if len(devices) > MAX_CPU_LANES:
            raise UserError(f"devices: {len(devices)} CPU lanes asked for; at most {MAX_CPU_LANES}")
    else:
        n = cuda_count()
        if n == 0:
            raise UserError(
                f"devices: {items[0]} asked for, but torch sees no CUDA GPU on this machine; "
                "use cpu:0,cpu:1 (CPU lanes) or auto"
            )
        bad = next((d for d in devices if d.index >= n), None)
        if bad:
            raise UserError(
                f"devices: {bad.name} does not exist; this machine has {n} CUDA GPU(s): cuda:0..cuda:{n - 1}"
            )
    return devices


def lane_names(devices: list[Device]) -> list[str]:
    """Names that tell lanes apart, also when one GPU carries two replicas (cuda:0, cuda:0#1)."""
    seen: dict[str, int] = {}
    names = []
    for d in devices:
        k = seen.get(d.name, 0)
        names.append(d.name if k == 0 else f"{d.name}#{k}")
        seen[d.name] = k + 1
    return names


LISTED_CPU_LANES = 8
"""How many CPU lanes the app's device list offers at most (one per core); a run may ask for more."""


def usable_cores() -> int:
    """The cores this process may run on (its affinity: a container's or taskset's share), else all."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cpu_lane_count() -> int:
    """How many CPU lanes the app offers and ``multilane devices`` lists: one per usable core, at
    least 2 (two lanes show data parallelism even on one core, slowly) and at most 8 (a list, not a
    limit: ``--devices cpu:0,...,cpu:15`` works)."""
    return max(2, min(LISTED_CPU_LANES, usable_cores()))


def describe_devices(problems: list[str] | None = None) -> list[dict]:
    """What this machine offers: every CUDA GPU with its memory, and the CPU (for lanes). A GPU that
    cannot be read, or a driver that does not answer, leaves its rows out and adds one line to
    ``problems`` (when given): the CPU is listed whatever the driver does."""
    out: list[dict] = []
    try:
        n = cuda_count()
    except UserError as e:
        n = 0
        if problems is not None:
            problems.append(str(e))
    for i in range(n):
        try:
            p = cuda_properties(i)
        except UserError as e:
            if problems is not None:
                problems.append(str(e))
            if driver_problem():
                break  # the driver stopped answering: the other GPUs would only repeat it
            continue
        out.append(
            {
                "name": f"cuda:{i}",
                "kind": "cuda",
                "model": p.name,
                "memory_total_mb": round(p.total_memory / 2**20),
                "multiprocessors": p.multi_processor_count,
                "capability": f"{p.major}.{p.minor}",
                "pci_bus_id": _pci_bus_id(i),
            }
        )
    import platform

    out.append(
        {
            "name": "cpu",
            "kind": "cpu",
            "model": _cpu_model() or platform.processor() or platform.machine(),
            "cores": usable_cores(),
            "lanes": cpu_lane_count(),
            "memory_total_mb": _total_memory_mb(),
            "note": "CPU lanes: cpu:0,cpu:1,... each lane is one thread on the CPU",
        }
    )
    return out


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _pci_bus_id(i: int) -> str | None:
    try:
        return cuda_properties(i).pci_bus_id
    except Exception:
        return None


def _total_memory_mb() -> int | None:
    try:
        import psutil

        return round(psutil.virtual_memory().total / 2**20)
    except Exception:
        return None
