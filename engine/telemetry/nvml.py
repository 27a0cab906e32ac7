"""GPU readings through NVML (nvidia-ml-py), with CUDA ordinals matched to NVML devices by PCI bus id.

CUDA and NVML may number GPUs differently (CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER=FASTEST_FIRST),
so ``cuda:i`` is found in NVML by its PCI domain/bus/device, or by UUID where torch gives no PCI id.
Handles are created once and cached. A reading the device does not support is left out — never
reported as 0 — and not asked for again. Every call into NVML (and torch's view of a device) is
bounded in time (``driver.py``): a driver that does not answer makes ``NvmlReader`` raise
``DriverNotAnswering`` at once, or, once open, read as empty from then on, saying why in ``problem``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from multilane.engine.telemetry.driver import DriverNotAnswering, bounded

MB = 2**20


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def torch_pci_id(index: int) -> tuple[int, int, int] | None:
    """(domain, bus, device) of CUDA device ``index`` as torch sees it, where torch reports it."""
    import torch

    p = torch.cuda.get_device_properties(index)
    try:
        return int(p.pci_domain_id), int(p.pci_bus_id), int(p.pci_device_id)
    except AttributeError:
        return None


def torch_uuid(index: int) -> str | None:
    import torch

    u = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return str(u) if u is not None else None


class NvmlReader:
    """Reads utilization, memory, temperature, power and SM clock of the CUDA devices a run uses.

    ``nvml`` is the pynvml module (tests pass a small fake, since CI has no GPU); ``pci_of`` and
    ``uuid_of`` give torch's view of a CUDA ordinal.
    """

    def __init__(
        self,
        cuda_indices: list[int],
        nvml: Any = None,
        pci_of: Callable[[int], tuple[int, int, int] | None] = torch_pci_id,
        uuid_of: Callable[[int], str | None] = torch_uuid,
    ) -> None:
        if nvml is None:
            import pynvml as nvml
        self.nvml = nvml
        self._unsupported: set[tuple[int, str]] = set()
        self.handles: dict[int, Any] = {}
        self.problem: str | None = None  # why readings stopped (the driver stopped answering)
        bounded(self._open, cuda_indices, pci_of, uuid_of)

    def _open(
        self,
        cuda_indices: list[int],
        pci_of: Callable[[int], tuple[int, int, int] | None],
        uuid_of: Callable[[int], str | None],
    ) -> None:
        nvml = self.nvml
        nvml.nvmlInit()
        by_pci: dict[tuple[int, int, int], Any] = {}
        by_uuid: dict[str, Any] = {}
        for k in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(k)
            info = nvml.nvmlDeviceGetPciInfo(h)
            by_pci[(int(info.domain), int(info.bus), int(info.device))] = h
            with contextlib.suppress(nvml.NVMLError):
                by_uuid[_text(nvml.nvmlDeviceGetUUID(h)).removeprefix("GPU-")] = h
        for i in sorted(set(cuda_indices)):
            pci = pci_of(i)
            h = by_pci.get(pci) if pci is not None else None
            if h is None:
                uuid = uuid_of(i)
                h = by_uuid.get(uuid.removeprefix("GPU-")) if uuid else None
            if h is not None:
                self.handles[i] = h

    def _get(self, i: int, name: str, fn: Callable[[], Any]) -> Any:
        if (i, name) in self._unsupported:
            return None
        try:
            return fn()
        except self.nvml.NVMLError_NotSupported:
            self._unsupported.add((i, name))
        except self.nvml.NVMLError:
            pass
        return None

    def read(self, i: int) -> dict[str, float]:
        """One reading of CUDA device ``i``; keys absent where unsupported or unmatched, and empty once
        the driver has stopped answering (``problem`` says so)."""
        h = self.handles.get(i)
        if h is None or self.problem is not None:
            return {}
        try:
            return bounded(self._read, i, h)
        except DriverNotAnswering as e:
            self.problem = str(e)
        except Exception as e:  # not an NVMLError (those are read as "not supported" in _get): a broken binding
            self.problem = f"NVML failed a reading of cuda:{i} ({type(e).__name__}: {e})"
        return {}

    def _read(self, i: int, h: Any) -> dict[str, float]:
        n = self.nvml
        out: dict[str, float] = {}
        util = self._get(i, "util", lambda: n.nvmlDeviceGetUtilizationRates(h))
        if util is not None:
            out["util_pct"] = float(util.gpu)
        mem = self._get(i, "mem", lambda: n.nvmlDeviceGetMemoryInfo(h))
        if mem is not None:
            out["mem_used_mb"] = mem.used / MB
            out["mem_total_mb"] = mem.total / MB
        temp = self._get(i, "temp", lambda: n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU))
        if temp is not None:
            out["temp_c"] = float(temp)
        power = self._get(i, "power", lambda: n.nvmlDeviceGetPowerUsage(h))
        if power is not None:
            out["power_w"] = power / 1000.0
        limit = self._get(i, "power_limit", lambda: n.nvmlDeviceGetEnforcedPowerLimit(h))
        if limit is not None:
            out["power_limit_w"] = limit / 1000.0
        clock = self._get(i, "sm_clock", lambda: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM))
        if clock is not None:
            out["sm_clock_mhz"] = float(clock)
        return out

    def close(self) -> None:
        if self.problem is not None:
            return
        with contextlib.suppress(Exception):
            bounded(self.nvml.nvmlShutdown)


def open_nvml(cuda_indices: list[int]) -> NvmlReader | None:
    """An NVML reader for these devices, or None where NVML is not available (no driver)."""
    if not cuda_indices:
        return None
    try:
        return NvmlReader(cuda_indices)
    except Exception:
        return None
