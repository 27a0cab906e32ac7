"""Where a NaN began: the log window that went non-finite, replayed from the state kept before it.

Steps that stay finite pay one thing only: at the start of each log window (every ``train.log_every``
steps) ``StepKeeper.keep`` copies the model's and the optimizer's state and the random streams (the
loader's micro-batches are a pure function of the run's seed: nothing to keep). The run detects a
non-finite loss at log time, as before. Then ``find_origin`` puts the kept state back, reads the
window's micro-batches again, and replays its steps — same batches, same random streams, the same
strategy and lanes — with hooks (``Tracer``) that note, per lane and in the order they ran:

- a non-finite value in the batch's inputs (the data);
- the first module whose output holds a non-finite value, and the batch rows that hold it;
- the first parameter whose gradient is non-finite (in the order backward made them);
- a lane whose loss is non-finite while every module output was finite (the loss function).

The first replayed step where any of these shows is the origin. The model, the optimizer and the random
streams are then put back as they were when the run noticed (its checkpoint and a resume see the run
as it was).
"""

from __future__ import annotations

import copy
import math
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from multilane.engine.parallel.replicas.lane_context import current_lane
from multilane.engine.parallel.tree import first_tensor
from multilane.engine.tensors.grads import dense_part
from torch import nn

if TYPE_CHECKING:
    from multilane.engine.run.trainer import Trainer

MAX_SAMPLES = 8  # sample indices named in the one line (the detail file keeps up to MAX_DETAIL)
MAX_DETAIL = 1000


def _clone(obj: Any) -> Any:
    """A deep copy whose tensors are fresh copies on their own device."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone(v) for v in obj)
    return copy.deepcopy(obj)


@dataclass
class Kept:
    """The state before a log window's first step."""

    step: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    scaler: dict[str, Any] | None
    rng: torch.Tensor
    lane_rng: dict[str, Any] | None


def _copy_into(old: Any, new: Any) -> Any:
    """``new`` copied into ``old``'s tensors where they fit (no fresh memory each window: new pages cost
    the next steps more than the copy), a fresh copy where they do not."""
    if isinstance(new, torch.Tensor):
        if (
            isinstance(old, torch.Tensor)
            and old.shape == new.shape
            and old.dtype == new.dtype
            and old.device == new.device
        ):
            return old.copy_(new.detach())
        return new.detach().clone()
    if isinstance(new, dict):
        prev = old if isinstance(old, dict) else {}
        return {k: _copy_into(prev.get(k), v) for k, v in new.items()}
    if isinstance(new, (list, tuple)):
        prev = old if isinstance(old, (list, tuple)) and len(old) == len(new) else [None] * len(new)
        return type(new)(_copy_into(a, b) for a, b in zip(prev, new, strict=True))
    return copy.deepcopy(new)


class StepKeeper:
    """Keeps the state before each log window (the only cost on steps that stay finite), in the same
    buffers from one window to the next."""

    def __init__(self) -> None:
        self.kept: Kept | None = None

    def keep(self, t: Trainer) -> None:
        self.kept = snapshot(t, self.kept)


def snapshot(t: Any, into: Kept | None = None, lane_rng: Any = None) -> Kept:
    """The trainer's state now; ``lane_rng``: the lanes' random streams (default: the strategy's)."""
    if lane_rng is None:
        random = getattr(t.strategy, "random", None)
        lane_rng = random.state_dict() if random is not None else None
    return Kept(
        step=t.step,
        model=_copy_into(into.model if into else None, t.model.state_dict()),
        optimizer=_copy_into(into.optimizer if into else None, t.optimizer.state_dict()),
        scaler=t.scaler.state_dict() if t.scaler.is_enabled() else None,
        rng=torch.get_rng_state(),
        lane_rng=_copy_into(into.lane_rng if into else None, lane_rng) if lane_rng is not None else None,
    )


def restore(t: Any, k: Kept, set_lane_rng: Any = None) -> None:
    """Put ``k`` back; ``set_lane_rng(state)`` puts the lanes' streams back (default: the strategy's)."""
    t.model.load_state_dict(k.model)
    t.optimizer.load_state_dict(_clone(k.optimizer))
    if k.scaler is not None:
        t.scaler.load_state_dict(k.scaler)
    torch.set_rng_state(k.rng)
    if set_lane_rng is None:
        random = getattr(t.strategy, "random", None)
        set_lane_rng = random.load_state_dict if random is not None else None
    if set_lane_rng is not None and k.lane_rng is not None:
        set_lane_rng(_clone(k.lane_rng))
    t.step = k.step


@dataclass
class Finding:
    lane: int
    seq: int  # the order it ran in, within its lane
    where: str  # a module path, a parameter name, "the input data", "the loss"
    rows: list[int] = field(default_factory=list)  # the lane's shard rows that hold non-finite values


def _bad_rows(t: torch.Tensor) -> list[int] | None:
    """The rows (dim 0) holding a non-finite value, or None if every value is finite."""
    if not t.is_floating_point() and not t.is_complex():
        return None
    bad = ~torch.isfinite(t.detach())
    if not bool(bad.any()):
        return None
    if t.dim() == 0:
        return []
    return torch.nonzero(bad.reshape(t.shape[0], -1).any(1)).reshape(-1).tolist()


class Tracer:
    """Hooks for a replay: records the first non-finite input, output and gradient of every lane.

    It is also the strategy's ``lane_grads`` while armed, so that replicate shows it each lane's own
    parameter copies (their gradients, before the lanes' are summed)."""

    armed = True

    def __init__(self, model: nn.Module, replicas: list[nn.Module], single: bool) -> None:
        self.names = [n for n, _ in model.named_parameters()]
        self._lock = threading.Lock()
        self._seq: dict[int, int] = {}
        self.inputs: dict[int, Finding] = {}
        self.outputs: dict[int, Finding] = {}
        self.bad_grads: dict[int, list[str]] = {}  # per lane, every parameter with a non-finite gradient
        self.ran: dict[int, dict[str, int]] = {}  # per lane: module path -> when its forward ended
        self._handles: list[Any] = []
        mods = [model, *[r for r in replicas if r is not model]]
        for lane_hint, m in enumerate(mods):
            hint = None if m is model else lane_hint
            self._handles.append(m.register_forward_pre_hook(self._pre_hook(hint)))
            for name, sub in m.named_modules():
                self._handles.append(sub.register_forward_hook(self._out_hook(name or type(m).__name__, hint)))
            if m is not model:  # persistent: hooks on the replica's own parameters
                self.watch_replicas([list(m.parameters())], [lane_hint])
        if replicas or single:  # lane 0's own parameters (replicate's copies come through watch_replicas)
            self._param_hooks(list(model.parameters()), 0)

    def _next(self, lane: int) -> int:
        with self._lock:
            s = self._seq.get(lane, 0)
            self._seq[lane] = s + 1
            return s

    @staticmethod
    def _lane(hint: int | None) -> int:
        ctx = current_lane()
        return ctx.lane if ctx is not None else (hint or 0)

    def _pre_hook(self, hint: int | None):
        def hook(_m: nn.Module, args: Any) -> None:
            lane = self._lane(hint)
            t = first_tensor(args)
            rows = _bad_rows(t) if t is not None else None
            if rows is not None and lane not in self.inputs:
                self.inputs[lane] = Finding(lane, -1, "the input data", rows)

        return hook

    def _out_hook(self, name: str, hint: int | None):
        def hook(_m: nn.Module, _args: Any, out: Any) -> None:
            lane = self._lane(hint)
            seq = self._next(lane)
            self.ran.setdefault(lane, {}).setdefault(name, seq)
            if lane in self.outputs:
                return
            t = first_tensor(out)
            rows = _bad_rows(t) if t is not None else None
            if rows is not None:
                self.outputs[lane] = Finding(lane, seq, name, rows)

        return hook

    def watch_replicas(self, params: list[list[torch.Tensor]], lanes: list[int]) -> None:
        for lane, lane_params in zip(lanes, params, strict=True):
            self._param_hooks(lane_params, lane)

    def watch_named(self, params: list[tuple[str, torch.Tensor]], lane: int) -> None:
        """Hooks on other tensors that receive a parameter's gradient (fsdp: each unit's unsharded
        parameter, this rank's own gradient before the reduce-scatter), each named by its parameter."""
        for name, p in params:
            if p.requires_grad:
                self._handles.append(p.register_hook(self._grad_hook(name, lane)))

    def take_lanes(self, params: Any) -> None:
        """(persistent's reduce: its replicas' gradients are watched by hooks already)"""

    def _param_hooks(self, params: list[torch.Tensor], lane: int | None) -> None:
        for j, p in enumerate(params):
            if p.requires_grad:
                self._handles.append(p.register_hook(self._grad_hook(self.names[j], lane)))

    def _grad_hook(self, name: str, lane_given: int | None):
        def hook(g: torch.Tensor | None) -> None:
            if g is None:  # no sample of this lane reached it
                return
            lane = lane_given if lane_given is not None else self._lane(None)
            if _bad_rows(dense_part(g).reshape(1, -1)) is not None:  # sparse: its values; DTensor: its shard
                with self._lock:
                    self.bad_grads.setdefault(lane, []).append(name)

        return hook

    @property
    def grads(self) -> dict[int, Finding]:
        """Per lane, the first parameter backward made non-finite: the one whose module's forward ended
        last (backward runs the forward in reverse), wherever the strategy sums the lanes' gradients."""
        out = {}
        for lane, names in self.bad_grads.items():
            ran = self.ran.get(lane, {})

            def ended(param: str, ran: dict[str, int] = ran) -> int:
                return ran.get(param.rpartition(".")[0], -1)

            # ties (one module's weight and bias): the model's own order
            first = max(names, key=lambda p: (ended(p), -self.names.index(p)))
            out[lane] = Finding(lane, -ended(first), first)
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


@dataclass
class Origin:
    step: int
    kind: str  # "input", "output", "loss", "gradient"
    where: str
    device: str
    samples: list[int]
    gradient: tuple[str, str] | None  # (parameter, device)
    loss: float | None
    detail: dict[str, Any]

    def line(self) -> str:
        """One line for the CLI, the window and status.json."""
        what = f"loss became {self.loss} at step {self.step}" if self.loss is not None else f"at step {self.step}"
        if self.kind == "input":
            text = f"{what}: non-finite values in the input data on {self.device}"
        elif self.kind == "output":
            text = f"{what}: first non-finite output in {self.where} on {self.device}"
        elif self.kind == "weights":
            text = f"{what}: the weights were already non-finite before it ({self.where}), from an earlier update"
        elif self.kind == "loss":
            text = f"{what}: every module's output was finite; the loss on {self.device} was not"
        else:
            text = f"{what}: first non-finite gradient in {self.where} on {self.device}"
        if self.samples:
            more = len(self.samples) - MAX_SAMPLES
            text += ", from samples " + ", ".join(str(s) for s in self.samples[:MAX_SAMPLES])
            text += f" and {more} more" if more > 0 else ""
        if self.gradient is not None and self.kind != "gradient":
            text += f"; first non-finite gradient in {self.gradient[0]} on {self.gradient[1]}"
        return text


def _first(found: dict[int, Finding]) -> Finding | None:
    return min(found.values(), key=lambda f: (f.seq, f.lane)) if found else None


def find_origin(t: Trainer, kept: Kept, last_step: int) -> Origin | None:
    """Replay steps ``kept.step + 1`` to ``last_step`` of trainer ``t`` with hooks; the first step where
    a non-finite value shows, or None (the replay stayed finite: not reproducible). ``t``'s state is
    put back as it was when called."""
    bad = weights_origin(kept, t.backend.lane_names[0])
    if bad is not None:
        return bad
    now = snapshot(t)
    saved = (t.loader, t.window, t.health.every, t.strategy.lane_grads, t.timer)
    window = type(t.window)  # the loop's log window (this module is below the loop: it is handed one)
    accum = t.config.train.grad_accum
    from multilane.engine.data.loader import build_loader

    loader = build_loader(t.task, t.config, None if t.backend.model_device.type != "cuda" else t.backend.model_device)
    try:
        restore(t, kept)
        loader.start(kept.step * accum, last_step * accum)
        t.loader, t.health.every = loader, 0
        for step in range(kept.step + 1, last_step + 1):
            t.window = window(t.backend.lane_names)
            t.window.resume()
            replicas = t._replicas() or []
            tracer = Tracer(t.model, replicas, single=len(t.devices) == 1)
            t.strategy.lane_grads = tracer
            try:
                t._train_step(accum)
            finally:
                tracer.remove()
            t.step = step
            origin = origin_of(t, step, tracer, t.window.record(step=step), accum, kept.step, t.backend.lane_names)
            if origin is not None:
                return origin
        return None
    finally:
        loader.close()
        t.loader, t.window, t.health.every, t.strategy.lane_grads, t.timer = saved
        restore(t, now)


def weights_origin(kept: Kept, device: str, bad: list[str] | None = None) -> Origin | None:
    """The weights the replay would start from, already non-finite (an earlier update made them so), or None.
    ``bad``: those non-finite, where the caller found them (fsdp: over every rank's shards)."""
    if bad is None:
        bad = [n for n, v in kept.model.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if not bad:
        return None
    detail = {"step": kept.step + 1, "weights": bad[:MAX_DETAIL]}
    return Origin(kept.step + 1, "weights", bad[0], device, [], None, None, detail)


def origin_of(
    t: Any, step: int, tracer: Any, rec: dict[str, Any] | None, accum: int, k0: int, names: list[str]
) -> Origin | None:
    """The origin a replayed step shows, from its findings per lane (``tracer``: ``inputs``, ``outputs``,
    ``grads``; under ddp a rank is a lane) and its record (its loss, when not finite, goes into the
    origin's line), or None when every value stayed finite."""
    loss = rec["loss"] if rec else math.nan
    loss = None if math.isfinite(loss) else loss
    bad_lanes = [k for k, v in (rec or {}).get("device_loss", {}).items() if not math.isfinite(v)]
    first_in, first_out, first_grad = _first(tracer.inputs), _first(tracer.outputs), _first(tracer.grads)
    grad = (first_grad.where, names[first_grad.lane]) if first_grad is not None else None
    if first_in is None and first_out is None and first_grad is None and not bad_lanes:
        return None
    found = first_in or first_out
    micro = (step - 1) * accum  # the step's first micro-batch (accumulation: rows of its first)
    samples = _samples(t, micro, found) if found is not None else []
    detail = {
        "step": step,
        "inputs": {names[f.lane]: f.rows[:MAX_DETAIL] for f in tracer.inputs.values()},
        "outputs": {names[f.lane]: {"module": f.where, "rows": f.rows[:MAX_DETAIL]} for f in tracer.outputs.values()},
        "gradients": {names[f.lane]: f.where for f in tracer.grads.values()},
        "device_loss": (rec or {}).get("device_loss"),
        "samples": samples[:MAX_DETAIL],
        "replayed_from_step": k0,
    }
    if first_in is not None:
        return Origin(step, "input", "the input data", names[first_in.lane], samples, grad, loss, detail)
    if first_out is not None:
        return Origin(step, "output", first_out.where, names[first_out.lane], samples, grad, loss, detail)
    if bad_lanes:
        return Origin(step, "loss", "the loss", bad_lanes[0], [], grad, loss, detail)
    assert first_grad is not None
    return Origin(step, "gradient", first_grad.where, names[first_grad.lane], [], None, loss, detail)


def _samples(t: Trainer, micro: int, found: Finding) -> list[int]:
    """The dataset indices of ``found``'s rows (its lane's shard of micro-batch ``micro``)."""
    indices = t.loader.sample_indices(micro) if hasattr(t.loader, "sample_indices") else None
    if indices is None:
        return []
    sizes = t._sizes(len(indices))
    lo = sum(sizes[: found.lane])
    return [indices[lo + r] for r in found.rows if lo + r < len(indices)]
