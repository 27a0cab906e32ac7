"""The environment a run ran in, saved beside its metrics (versions, devices, machine)."""

from __future__ import annotations

import os
import platform
import socket
import sys
from typing import Any

import torch
from multilane.engine import __version__
from multilane.engine.telemetry.devices import cuda_count, describe_devices
from multilane.engine.telemetry.driver import bounded


def _driver_version() -> str:
    import pynvml

    pynvml.nvmlInit()
    try:
        v = pynvml.nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else str(v)
    finally:
        pynvml.nvmlShutdown()


def nvidia_driver_version() -> str | None:
    try:
        return bounded(_driver_version)
    except Exception:  # no driver, or one that does not answer (bounded: at most driver.TIMEOUT_S)
        return None


def _cuda_available() -> bool:
    try:
        return cuda_count() > 0
    except Exception:
        return False


def environment() -> dict[str, Any]:
    cuda = _cuda_available()
    return {
        "multilane": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda_available": cuda,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "nvidia_driver": nvidia_driver_version() if cuda else None,
        "devices": describe_devices(),
    }
