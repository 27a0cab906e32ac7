"""A ddp rank's log window: its shard's losses summed on its device, read once per log window.

``combine`` turns every rank's window (gathered to every rank with one collective, so all ranks
agree on the record and on a non-finite loss) into the run's train record: the combined loss is the
sum of the ranks' size-weighted shard losses, exactly the full-batch mean; ``device_loss`` holds
each rank's own shard loss under its key (host/rank/device).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from multilane.engine.run.metrics_window import ActiveClock


class ShardWindow(ActiveClock):
    def __init__(self) -> None:
        self._t0: float | None = None
        self.reset()

    def reset(self) -> None:
        self._contrib: torch.Tensor | None = None  # sum over micro-batches of (n_r / N) * shard loss
        self._shard: torch.Tensor | None = None  # sum of shard losses where this rank had samples
        self._grad_norm: torch.Tensor | None = None
        self.norms = 0  # steps whose gradient norm was taken (every step when clipping, else the log step)
        self.count = 0  # micro-batches in which this rank had samples
        self.micro = 0
        self.samples = 0  # global samples (every rank counts the whole batch)
        self.steps = 0
        self.first_step: int | None = None
        self._active_s = 0.0
        self._t0 = time.perf_counter()

    def add(self, contrib: torch.Tensor, shard_loss: torch.Tensor | None, size: int, step: int) -> None:
        if self.first_step is None:
            self.first_step = step
        self._contrib = contrib if self._contrib is None else self._contrib + contrib
        if shard_loss is not None:
            self._shard = shard_loss if self._shard is None else self._shard + shard_loss
            self.count += 1
        self.micro += 1
        self.samples += size

    def add_grad_norm(self, norm: torch.Tensor) -> None:
        n = norm.detach()
        self._grad_norm = n if self._grad_norm is None else self._grad_norm + n
        self.norms += 1

    def end_step(self) -> None:
        self.steps += 1

    def loss_finite(self) -> torch.Tensor | None:
        """Whether this rank's part of the open window's loss is finite (a 0-dim bool device tensor, no
        sync), or None when the window is empty; see ``MetricsWindow.loss_finite``."""
        return None if self.micro == 0 or self._contrib is None else torch.isfinite(self._contrib).all()

    def take(self) -> dict[str, Any] | None:
        """This rank's window as plain numbers (the one device sync), then a fresh window."""
        if self.micro == 0 or self._contrib is None:
            return None
        parts = [self._contrib.reshape(1).double()]
        parts.append((self._shard if self._shard is not None else torch.zeros_like(self._contrib)).reshape(1).double())
        if self._grad_norm is not None:
            parts.append(self._grad_norm.reshape(1).to(parts[0]))
        values = torch.cat([p.to(parts[0].device) for p in parts]).tolist()
        out = {
            "contrib": values[0],
            "shard": values[1],
            "count": self.count,
            "micro": self.micro,
            "samples": self.samples,
            "steps": self.steps,
            "first_step": self.first_step,
            "active_s": self.active_seconds(),
            "grad_norm": values[2] if len(values) > 2 else None,
            "norms": self.norms,
        }
        self.reset()
        return out

    # A ddp checkpoint carries no open window (a stop logs it whole); same format as the engine's.
    def state_dict(self) -> None:
        return None

    def load_state_dict(self, state: Any, device: torch.device) -> None:
        return None


def combine(windows: list[dict[str, Any]], keys: list[str], **fields: Any) -> dict[str, Any]:
    """The run's train record from every rank's window (rank order); rank 0's clock times it."""
    w0 = windows[0]
    micro, dt, steps = w0["micro"], w0["active_s"], max(1, w0["steps"])
    rec: dict[str, Any] = {
        "kind": "train",
        **fields,
        "loss": sum(w["contrib"] for w in windows) / micro,
        "device_loss": {k: w["shard"] / w["count"] for k, w in zip(keys, windows, strict=True) if w["count"]},
        "samples_per_s": w0["samples"] / dt if dt > 0 else None,
        "step_ms": 1000.0 * dt / steps,
    }
    if w0["grad_norm"] is not None:
        rec["grad_norm"] = w0["grad_norm"] / max(1, w0.get("norms", steps))
    return rec
