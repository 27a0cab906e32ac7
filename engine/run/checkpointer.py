"""Checkpoints: what one holds, saving it into the run folder, restoring a run from it.

A checkpoint loads with ``torch.load(path, weights_only=True)``: tensors, numbers, strings, lists and
dicts only, never a pickled object.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
from multilane.engine import __version__

if TYPE_CHECKING:
    from multilane.engine.run.trainer import Trainer


def checkpoint_state(t: Trainer) -> dict[str, Any]:
    """What a checkpoint of trainer ``t`` holds."""
    return {
        "model": t.model.state_dict(),
        "optimizer": t.optimizer.state_dict(),
        "scaler": t.scaler.state_dict() if t.scaler.is_enabled() else None,
        "step": t.step,
        "total_steps": t.total_steps,
        "config": t.config.to_dict(),
        "rng": torch.get_rng_state(),
        "lane_rng": _lane_random(t).state_dict() if _lane_random(t) is not None else None,
        "metrics_window": t.window.state_dict(),
        "health": t.health.state_dict() if getattr(t, "health", None) is not None else None,
        "multilane": __version__,
    }


def restore(t: Trainer, ck: dict[str, Any]) -> None:
    """Put trainer ``t`` (set up, not yet running) back where checkpoint ``ck`` left it."""
    t.model.load_state_dict(ck["model"])
    t.optimizer.load_state_dict(ck["optimizer"])
    if ck.get("scaler"):
        t.scaler.load_state_dict(ck["scaler"])
    if isinstance(ck.get("rng"), torch.Tensor):
        torch.set_rng_state(ck["rng"])
    lane_rng, streams = ck.get("lane_rng"), _lane_random(t)
    if streams is not None and lane_rng and len(lane_rng.get("lanes") or []) == len(t.devices):
        # Each lane's random stream (lane 0's includes its GPU's generator). Resumed on another lane
        # count, lanes start fresh streams: a run reproduces on a given lane count only.
        streams.load_state_dict(lane_rng)
    t.step = int(ck["step"])
    if ck.get("metrics_window") is not None:
        t.window.load_state_dict(ck["metrics_window"], t.backend.output_device)
    if getattr(t, "health", None) is not None:
        t.health.load_state_dict(ck.get("health"))


def _lane_random(t: Trainer) -> Any:
    """The lanes' random streams of a single-process run, or a ddp run's ranks' (one lane per rank,
    the same format: engine/distributed/rank_state.py); a ddp rank restores its own."""
    streams = getattr(t, "streams", None)
    if streams is not None:
        return streams
    strategy = getattr(t, "strategy", None)
    return getattr(strategy, "random", None)


def save(t: Trainer) -> None:
    """Write ``t``'s checkpoint into its run folder (atomically: the previous one stays until then)."""
    assert t.run_dir is not None
    t.run_dir.save_checkpoint(checkpoint_state(t))
    t.checkpoint_step = t.step
    t.checkpoint_time = time.monotonic()


def due(t: Trainer) -> bool:
    """Whether ``train.checkpoint_minutes`` of wall time have passed since the last checkpoint (or
    the start): the default cadence, so that a crash never costs more than that much work."""
    minutes = t.config.train.checkpoint_minutes
    return minutes > 0 and time.monotonic() - t.checkpoint_time >= 60.0 * minutes
