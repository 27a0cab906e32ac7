"""The environment a run ran in, saved beside its metrics (versions, devices, machine)."""

from __future__ import annotations

import os
import platform
import socket
import sys
from typing import Any

import torch
from multilane.engine import __version__
from multilane.engine.telemetry.devices import describe_devices


def nvidia_driver_version() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            v = pynvml.nvmlSystemGetDriverVersion()
            return v.decode() if isinstance(v, bytes) else str(v)
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None


def environment() -> dict[str, Any]:
    return {
        "multilane": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda_available": torch.cuda.is_available(),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        "nvidia_driver": nvidia_driver_version() if torch.cuda.is_available() else None,
        "devices": describe_devices(),
    }
