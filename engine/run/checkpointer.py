"""Checkpoints: what one holds, saving it into the run folder, restoring a run from it.

A checkpoint loads with ``torch.load(path, weights_only=True)``: tensors, numbers, strings, lists and
dicts only, never a pickled object. A checkpoint is only written of a finite state (``save_finite``):
the losses of every step it contains and every parameter the optimizer updates are checked first, so
``last.pt`` is always the last good state.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
from multilane.engine import __version__
from multilane.engine.errors import UserError
from multilane.engine.run.metrics_window import NonFiniteLoss
from multilane.engine.rundir.runread import CHECKPOINT
from multilane.engine.tensors import frozen

if TYPE_CHECKING:
    from multilane.engine.run.trainer import Trainer


def checkpoint_state(t: Trainer) -> dict[str, Any]:
    """What a checkpoint of trainer ``t`` holds. The model's part: ``frozen.checkpoint_model_state``
    (its trainable state and the frozen base's name and hash where some parameters are frozen)."""
    return {
        **frozen.checkpoint_model_state(t.model, frozen.base_source(t.task, t.model)),
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
    """Put trainer ``t`` (set up, not yet running) back where checkpoint ``ck`` left it. A checkpoint
    that does not fit the run (damaged, or another model's) is refused in one line naming the
    checkpoint and the part that does not fit, not the task; so is one trained over another frozen
    base (``frozen.check_base``)."""
    base = ck.get("frozen_base") if isinstance(ck.get("frozen_base"), dict) else None
    frozen.check_base(t.model, base, str(_where(t)))
    if ck.get("sharded") is not None or t.spread.sharded:
        # A sharded checkpoint (engine/fsdp/sharded.py), or any checkpoint into a sharded model.
        from multilane.engine.fsdp.sharded import restore_model

        assert t._resume_dir is not None
        restore_model(t.model, t.optimizer, ck, t._resume_dir.path)
    else:
        load = lambda state: frozen.load_trainable(t.model, state, base)  # noqa: E731
        _load(t, "model weights", f"task {t.task.name}'s model", load, ck.get("model"))
        _load(
            t,
            "optimizer state",
            f"this run's {t.config.optim.name} optimizer",
            t.optimizer.load_state_dict,
            ck.get("optimizer"),
        )
    if ck.get("scaler"):
        _load(t, "gradient scaler state", "this run's scaler", t.scaler.load_state_dict, ck["scaler"])
    if isinstance(ck.get("rng"), torch.Tensor):
        _load(t, "random state", "this process's generator", torch.set_rng_state, ck["rng"])
    lane_rng, streams = ck.get("lane_rng"), _lane_random(t)
    if streams is not None and lane_rng and len(lane_rng.get("lanes") or []) == len(t.devices):
        # Each lane's random stream (lane 0's includes its GPU's generator). Resumed on another lane
        # count, lanes start fresh streams: a run reproduces on a given lane count only.
        _load(t, "lanes' random state", "this run's lanes", streams.load_state_dict, lane_rng)
    t.step = int(ck["step"])
    if ck.get("metrics_window") is not None:
        window = ck["metrics_window"]
        _load(t, "log window", "this run", lambda w: t.window.load_state_dict(w, t.backend.output_device), window)
    if getattr(t, "health", None) is not None:
        _load(t, "health state", "this run's health meters", t.health.load_state_dict, ck.get("health"))


def _load(t: Trainer, part: str, target: str, load: Any, state: Any) -> None:
    try:
        load(state)
    except Exception as e:
        where = _where(t)
        reason = " ".join(f"{type(e).__name__}: {e}".split())
        raise UserError(f"checkpoint {where}: the {part} it holds cannot be loaded into {target} ({reason})") from None


def _where(t: Trainer) -> Any:
    rd = getattr(t, "_resume_dir", None)
    return rd.path / CHECKPOINT if rd is not None else "the checkpoint"


def _lane_random(t: Trainer) -> Any:
    """The lanes' random streams of a single-process run, or a ddp run's ranks' (one lane per rank,
    the same format: engine/distributed/rank_state.py); a ddp rank restores its own."""
    streams = getattr(t.spread, "streams", None)
    if streams is not None:
        return streams
    strategy = getattr(t, "strategy", None)
    return getattr(strategy, "random", None)


def finite_flag(t: Trainer, device: torch.device) -> torch.Tensor:
    """A 0-dim bool tensor on ``device``: the open log window's loss (the steps since the last record;
    the records before it were checked as they were logged), every parameter the optimizer updates and
    the optimizer's state (momentum, Adam's moments; this rank's shards under fsdp) are finite. Reading
    it is the one device sync. (The engine's optimizers, SGD, Adam and AdamW, keep no inf on purpose.)"""
    window = t.window.loss_finite()
    parts = [window] if window is not None else []
    params = [p for group in t.optimizer.param_groups for p in group["params"]]
    states = [v for state in t.optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    for tensor in params + states:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor: this rank's shard
        values = local.detach()
        if values.is_sparse:
            values = values.coalesce().values()
        if values.is_floating_point() or values.is_complex():
            parts.append(torch.isfinite(values).all())
    # Each device's flags reduced where they are, then one small copy per device (not one per parameter).
    on = {f.device: [] for f in parts}
    for f in parts:
        on[f.device].append(f)
    flags = [torch.stack(fs).all().to(device) for fs in on.values()]
    return torch.stack(flags).all() if flags else torch.ones((), dtype=torch.bool, device=device)


def save_finite(t: Trainer) -> None:
    """Save ``t``'s checkpoint once its state is known finite (``t._state_finite()``: one device read,
    and under ddp/fsdp the ranks' agreement). Otherwise nothing is saved, so the last checkpoint stays
    the last finite state: the open log window is logged (its record shows the non-finite loss, and
    ``NonFiniteLoss`` names its steps), or, when every loss was finite but an update made the weights
    inf or NaN (an inf gradient), ``NonFiniteLoss`` says so."""
    if not t._state_finite():
        t._log()
        raise NonFiniteLoss(f"{WEIGHTS} by step {t.step} while every loss was finite (an inf or NaN update)")
    save(t)


WEIGHTS = "the weights or the optimizer's state became non-finite"
"""How the message of a run whose weights (or optimizer state), not its loss, went non-finite begins."""


def diverged_message(t: Trainer, e: NonFiniteLoss) -> str:
    """The one line of a run that diverged: where the NaN began when health's replay finds it (its line
    for weights reads "at step s: first non-finite gradient in …", put after ``WEIGHTS``)."""
    message = t.run_health.explain(str(e), t.step, t.run_dir)
    if str(e).startswith(WEIGHTS) and not message.startswith(str(e)):
        message = f"{WEIGHTS} {message}"
    return message


def save(t: Trainer) -> None:
    """Write ``t``'s checkpoint into its run folder (atomically: the previous one stays until then)."""
    assert t.run_dir is not None
    t.run_dir.save_checkpoint(t.checkpoint_state())  # a sharded model's writes its shards first
    saved = getattr(t.spread, "checkpoint_saved", None)  # a sharded checkpoint's folders (fsdp)
    if saved is not None:
        saved(t)
    elif (t._checkpoint or {}).get("sharded") and t.run_dir.writes:  # resumed from shards, saved whole
        from multilane.engine.fsdp.sharded import remove_older

        remove_older(t.run_dir.path / "checkpoints", keep="last.pt")
    t.checkpoint_step = t.step
    t.checkpoint_time = time.monotonic()


def due(t: Trainer) -> bool:
    """Whether ``train.checkpoint_minutes`` of wall time have passed since the last checkpoint (or
    the start): the default cadence, so that a crash never costs more than that much work."""
    minutes = t.config.train.checkpoint_minutes
    return minutes > 0 and time.monotonic() - t.checkpoint_time >= 60.0 * minutes
