"""Splitting the sweep's devices into slots of ``per_trial`` devices; each slot runs one trial at a time."""

from __future__ import annotations

from multilane.engine.errors import UserError


def split_slots(devices: str, per_trial: int = 1) -> list[str]:
    """``cuda:0,cuda:1,cuda:2,cuda:3`` with 2 per trial -> ["cuda:0,cuda:1", "cuda:2,cuda:3"]; on CPU lanes one lane is one slot."""
    from multilane.engine.telemetry.devices import parse_devices

    names = [d.name for d in parse_devices(devices)]
    if per_trial < 1:
        raise UserError(f"--per-trial {per_trial}: must be at least 1")
    if per_trial > len(names):
        raise UserError(f"--per-trial {per_trial}: only {len(names)} device(s) given ({', '.join(names)})")
    if len(names) % per_trial:
        left = names[len(names) - len(names) % per_trial :]
        raise UserError(
            f"--per-trial {per_trial}: {len(names)} devices do not split into slots of {per_trial} "
            f"({', '.join(left)} would be left over)"
        )
    return [",".join(names[i : i + per_trial]) for i in range(0, len(names), per_trial)]
