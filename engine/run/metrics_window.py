"""The log window: what the trainer accumulates between two train records, read from the device once.

Losses stay on the device as running sums (no sync per step); ``record()`` reads them all in one
transfer at log time. The window's sums travel in checkpoints (``state_dict``), so a run stopped or
killed mid-window and resumed logs the very record an uninterrupted run would have.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import torch
from multilane.engine.parallel import StepOutput

NONFINITE = "loss became "
"""How the message of a run that diverged on a non-finite loss begins (status.json's message)."""


class NonFiniteLoss(RuntimeError):
    pass


class ActiveClock:
    """A log window's running time: paused time is not training time, so samples/s counts only the
    time spent running. Subclasses set ``_active_s`` and ``_t0`` (None while stopped)."""

    _active_s: float = 0.0
    _t0: float | None = None

    def pause(self) -> None:
        if self._t0 is not None:
            self._active_s += time.perf_counter() - self._t0
            self._t0 = None

    def resume(self) -> None:
        if self._t0 is None:
            self._t0 = time.perf_counter()

    def active_seconds(self) -> float:
        return self._active_s + (time.perf_counter() - self._t0 if self._t0 is not None else 0.0)


class MetricsWindow(ActiveClock):
    """Sums of the combined and per-lane losses, gradient norms and samples since the last record."""

    def __init__(self, lane_names: Sequence[str]) -> None:
        self.lane_names = list(lane_names)
        self.reset()
        self._t0 = None  # the clock starts with the loop (``resume()``), not at set-up

    def reset(self) -> None:
        n = len(self.lane_names)
        self._loss_sum: torch.Tensor | None = None
        self._lane_sum: torch.Tensor | None = None
        self._lane_count = [0] * n
        self._norms: list[torch.Tensor] = []  # summed at log time: no device op per step
        self.norms = 0  # steps whose gradient norm was taken (every step when clipping, else the log step)
        self.micro = 0
        self.samples = 0
        self.steps = 0
        self.first_step: int | None = None
        self._active_s = 0.0  # training time before the latest pause
        self._t0: float | None = time.perf_counter()

    @property
    def empty(self) -> bool:
        return self.micro == 0 or self._lane_sum is None

    # -- accumulating (every micro-batch / step) -------------------------------------------------
    def add(self, out: StepOutput, size: int, step: int) -> None:
        """One micro-batch's losses (device tensors, no sync)."""
        lane_sum, counts = self._lane_sum, self._lane_count
        if lane_sum is None:  # the window's first: accumulate in the loss's own dtype, no cast per step
            if self.first_step is None:
                self.first_step = step
            lane_sum = self._lane_sum = torch.zeros(
                len(counts), dtype=out.lane_losses.dtype, device=out.lane_losses.device
            )
        if len(counts) > 1:  # with one lane the combined loss is the lane's loss
            loss = out.loss.detach()
            self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
        if len(out.lanes) == len(counts):
            lane_sum += out.lane_losses
        else:
            idx = torch.tensor(out.lanes, device=lane_sum.device)
            lane_sum.index_add_(0, idx, out.lane_losses.reshape(-1).to(lane_sum.dtype))
        for lane in out.lanes:
            counts[lane] += 1
        self.micro += 1
        self.samples += size

    def add_grad_norm(self, norm: torch.Tensor) -> None:
        self._norms.append(norm.detach())
        self.norms += 1

    def end_step(self) -> None:
        self.steps += 1

    def loss_finite(self) -> torch.Tensor | None:
        """Whether the open window's combined loss is finite: a 0-dim bool tensor on the device (no
        sync), or None when the window is empty. A sum is finite only when every term is (an inf or
        NaN term keeps it inf or NaN), so this answers for every step since the last record."""
        if self.empty:
            return None
        assert self._lane_sum is not None
        return torch.isfinite(self._lane_sum if self._loss_sum is None else self._loss_sum).all()

    # -- reading (at log time) --------------------------------------------------------------------
    def record(self, **fields: Any) -> dict[str, Any] | None:
        """The train record of this window (None if empty), then a fresh window.

        The one device sync of a log window: all values come back in a single transfer.
        """
        if self.empty:
            return None
        assert self._lane_sum is not None
        loss_sum = self._lane_sum if self._loss_sum is None else self._loss_sum
        parts = [loss_sum.reshape(1), self._lane_sum]
        if self._norms:  # summed in one op whether or not the window was resumed (its norms travel one by one)
            parts.append(torch.stack(self._norms).sum().to(self._lane_sum).reshape(1))
        values = torch.cat(parts).tolist()
        dt = self.active_seconds()
        names = self.lane_names
        rec: dict[str, Any] = {
            "kind": "train",
            **fields,
            "loss": values[0] / self.micro,
            "device_loss": {names[i]: values[1 + i] / c for i, c in enumerate(self._lane_count) if c},
            "samples_per_s": self.samples / dt if dt > 0 else None,
            "step_ms": 1000.0 * dt / max(1, self.steps),
        }
        if len(values) > 1 + len(names):
            rec["grad_norm"] = values[-1] / max(1, self.norms)
        self.reset()
        return rec

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The open window, for a checkpoint (tensors, ints and floats only: weights_only-loadable)."""
        return {
            "loss_sum": None if self._loss_sum is None else self._loss_sum.detach().cpu(),
            "lane_sum": None if self._lane_sum is None else self._lane_sum.detach().cpu(),
            "lane_count": list(self._lane_count),
            "grad_norms": torch.stack(self._norms).cpu() if self._norms else None,
            "micro": self.micro,
            "samples": self.samples,
            "steps": self.steps,
            "norms": self.norms,
            "first_step": self.first_step,
            "active_s": self.active_seconds(),
        }

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        """Continue the window a checkpoint saved (one with the same lanes; otherwise start afresh)."""
        self.reset()
        if not isinstance(state, dict) or len(state.get("lane_count") or []) != len(self.lane_names):
            return
        self._loss_sum = None if state["loss_sum"] is None else state["loss_sum"].to(device)
        self._lane_sum = None if state["lane_sum"] is None else state["lane_sum"].to(device)
        self._lane_count = [int(c) for c in state["lane_count"]]
        norms, older = state.get("grad_norms"), state.get("grad_norm_sum")  # older: a running sum
        self._norms = list(norms.to(device).unbind()) if isinstance(norms, torch.Tensor) else []
        if isinstance(older, torch.Tensor):
            self._norms.insert(0, older.to(device).reshape(()))
        self.micro, self.samples, self.steps = int(state["micro"]), int(state["samples"]), int(state["steps"])
        self.norms = int(state.get("norms", self.steps))  # a checkpoint from before: a norm every step
        self.first_step = state["first_step"]
        self._active_s = float(state["active_s"])
        self._t0 = None


def check_finite(rec: dict[str, Any], first: int, step: int) -> None:
    """NonFiniteLoss naming the steps (``first`` to ``step``) and the devices whose shard loss went bad."""
    loss = rec["loss"]
    if math.isfinite(loss):
        return
    device_loss = rec["device_loss"]
    bad = [k for k, v in device_loss.items() if not math.isfinite(v)] or list(device_loss)
    where = f"at step {step}" if first == step else f"between steps {first} and {step}"
    on = f" on device {', '.join(bad)}" if bad else ""
    raise NonFiniteLoss(f"{NONFINITE}{loss} {where}{on}")
