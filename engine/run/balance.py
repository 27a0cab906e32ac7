"""Warnings before a run about devices that will hold each other back."""

from __future__ import annotations

import os

from multilane.engine.errors import UserError
from multilane.engine.telemetry.devices import Device, cuda_properties

# torch's DataParallel warns when a device has under 75% of the best one's memory or cores.
IMBALANCE_RATIO = 0.75


def balance_warnings(
    devices: list[Device], props: dict[int, dict] | None = None, cores: int | None = None
) -> list[str]:
    """Plain-language warnings for the chosen devices (empty when they are well matched).

    ``props`` maps a CUDA index to ``{"memory_total_mb", "multiprocessors", "model"}`` and ``cores`` is
    the CPU's: by default this machine's (torch's properties, ``os.cpu_count``); another host's come
    from its ``multilane devices --json`` (a value it did not give is not compared).
    """
    out: list[str] = []
    cuda = sorted({d.index for d in devices if d.is_cuda})
    if len(cuda) > 1:
        try:
            props = props or _torch_props(cuda)
        except UserError as e:  # a GPU CUDA cannot read, a driver that does not answer: said, not raised
            return [str(e)]
        for key, what in (("memory_total_mb", "memory"), ("multiprocessors", "multiprocessors")):
            values = {i: props.get(i, {}).get(key) for i in cuda}
            if any(v is None for v in values.values()):
                continue
            best = max(values.values())
            for i, v in values.items():
                if v < IMBALANCE_RATIO * best:
                    out.append(
                        f"cuda:{i} ({props[i]['model']}) has {v:,} {what} against {best:,} on the best chosen GPU: "
                        "an even split waits for it every step; give it a smaller share (the app's share column; devices.weights in a config)"
                    )
    cpu_lanes = [d for d in devices if not d.is_cuda]
    cores = cores or os.cpu_count() or 1
    if len(cpu_lanes) > cores:
        out.append(
            f"{len(cpu_lanes)} CPU lanes on {cores} cores: lanes will wait for each other; "
            "CPU lanes exercise the data-parallel path, they do not speed up CPU training"
        )
    return out


def _torch_props(indices: list[int]) -> dict[int, dict]:
    out = {}
    for i in indices:
        p = cuda_properties(i)  # bounded in time; one line when CUDA cannot read it
        out[i] = {
            "memory_total_mb": p.total_memory // 2**20,
            "multiprocessors": p.multi_processor_count,
            "model": p.name,
        }
    return out
