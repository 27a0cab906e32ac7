"""The hooks of a NaN replay (nan_origin.py): what each lane's forward, loss and backward showed.

``Tracer`` notes, per lane and in the order they ran, the first non-finite value in the batch's inputs,
in a module's output, in the loss, and in a parameter's gradient — each with the global micro-batch it
came from (``Cursor``, advanced by the replay's loader), so that under gradient accumulation a finding
names the micro-batch that held it, not the step's first. It also keeps, per micro-batch and module,
each row's largest absolute value (``peaks``: the input and every module output with one row per
sample), from which a finding with no rows of its own (the loss, a gradient, or every row at once)
can still name the sample that stands out (origin.py, ``outlier_rows``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from multilane.engine.parallel.replicas.lane_context import current_lane
from multilane.engine.parallel.tree import first_tensor
from multilane.engine.tensors.grads import dense_part
from torch import nn

INPUT = "the input data"
"""The ``peaks`` key (and a finding's ``where``) of the batch's inputs."""


@dataclass
class Finding:
    lane: int
    seq: int  # the order it ran in, within its lane
    where: str  # a module path, a parameter name, "the input data", "the loss"
    rows: list[int] = field(default_factory=list)  # the lane's shard rows that hold non-finite values
    micro: int = 0  # the run's global micro-batch it ran on
    span: int | None = None  # the finding tensor's dim-0 length (rows are samples when it equals ``shard``)
    shard: int | None = None  # the lane's rows in that micro-batch


class Cursor:
    """The global micro-batch the replay's loader handed out last (``empty``: this rank's shard of it
    is empty, and its forward runs on a stand-in that is not the batch's)."""

    def __init__(self, m: int = 0) -> None:
        self.m, self.empty = m, False


def bad_rows(t: torch.Tensor) -> list[int] | None:
    """The rows (dim 0) holding a non-finite value, or None if every value is finite."""
    if not t.is_floating_point() and not t.is_complex():
        return None
    bad = ~torch.isfinite(t.detach())
    if not bool(bad.any()):
        return None
    if t.dim() == 0:
        return []
    return torch.nonzero(bad.reshape(t.shape[0], -1).any(1)).reshape(-1).tolist()


def _peak(t: torch.Tensor) -> torch.Tensor:
    """Each row's largest absolute value (NaN where a row holds one), float64, on its device."""
    return t.detach().abs().reshape(t.shape[0], -1).amax(1).double()


class Tracer:
    """Hooks for a replay: records the first non-finite input, output, loss and gradient of every lane.

    It is also the strategy's ``lane_grads`` while armed, so that replicate shows it each lane's own
    parameter copies (their gradients, before the lanes' are summed)."""

    armed = True

    def __init__(self, model: nn.Module, replicas: list[nn.Module], single: bool, cursor: Cursor | None = None) -> None:
        self.names = [n for n, _ in model.named_parameters()]
        self.cursor = cursor or Cursor()
        self._lock = threading.Lock()
        self._seq: dict[int, int] = {}
        self.inputs: dict[int, Finding] = {}
        self.outputs: dict[int, Finding] = {}
        self.losses: dict[int, Finding] = {}
        self.bad_grads: dict[int, list[tuple[str, int]]] = {}  # per lane: (parameter, micro-batch), as made
        self.ran: dict[int, dict[str, int]] = {}  # per lane: module path -> when its forward ended
        self.peaks: dict[tuple[int, str], dict[int, Any]] = {}  # (micro, module) -> lane -> per-row peak
        self._rows: dict[int, int] = {}  # per lane: its shard's rows in the forward now running
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

    def _keep_peak(self, lane: int, name: str, t: torch.Tensor) -> None:
        rows = self._rows.get(lane)
        if rows and t.dim() >= 1 and t.shape[0] == rows and t.numel() and (t.is_floating_point() or t.is_complex()):
            with self._lock:
                self.peaks.setdefault((self.cursor.m, name), {}).setdefault(lane, _peak(t))

    def _pre_hook(self, hint: int | None):
        def hook(_m: nn.Module, args: Any) -> None:
            if self.cursor.empty:
                return
            lane = self._lane(hint)
            t = first_tensor(args)
            if t is None:
                return
            self._rows[lane] = int(t.shape[0]) if t.dim() else 0
            self._keep_peak(lane, INPUT, t)
            rows = bad_rows(t)
            if rows is not None and lane not in self.inputs:
                self.inputs[lane] = Finding(lane, -1, INPUT, rows, self.cursor.m, self._rows[lane], self._rows[lane])

        return hook

    def _out_hook(self, name: str, hint: int | None):
        def hook(_m: nn.Module, _args: Any, out: Any) -> None:
            if self.cursor.empty:
                return
            lane = self._lane(hint)
            seq = self._next(lane)
            self.ran.setdefault(lane, {}).setdefault(name, seq)
            t = first_tensor(out)
            if t is None:
                return
            self._keep_peak(lane, name, t)
            if lane in self.outputs:
                return
            rows = bad_rows(t)
            if rows is not None:
                span = int(t.shape[0]) if t.dim() else None
                self.outputs[lane] = Finding(lane, seq, name, rows, self.cursor.m, span, self._rows.get(lane))

        return hook

    def loss(self, fn: Any) -> Any:
        """The task's loss function, noting each lane's first non-finite loss (with its micro-batch)."""

        def traced(output: Any, target: Any) -> Any:
            value = fn(output, target)
            if isinstance(value, torch.Tensor) and not self.cursor.empty:
                lane = self._lane(None)
                if lane not in self.losses and bad_rows(value.reshape(-1)) is not None:
                    self.losses[lane] = Finding(lane, self._next(lane), "the loss", [], self.cursor.m)
            return value

        return traced

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
            if bad_rows(dense_part(g).reshape(1, -1)) is not None:  # sparse: its values; DTensor: its shard
                with self._lock:
                    self.bad_grads.setdefault(lane, []).append((name, self.cursor.m))

        return hook

    @property
    def grads(self) -> dict[int, Finding]:
        """Per lane, the first parameter backward made non-finite, in the first micro-batch that made
        one: the one whose module's forward ended last (backward runs the forward in reverse),
        wherever the strategy sums the lanes' gradients."""
        out = {}
        for lane, found in self.bad_grads.items():
            ran = self.ran.get(lane, {})
            micro = min(m for _, m in found)
            names = [n for n, m in found if m == micro]

            def ended(param: str, ran: dict[str, int] = ran) -> int:
                return ran.get(param.rpartition(".")[0], -1)

            # ties (one module's weight and bias): the model's own order
            first = max(names, key=lambda p: (ended(p), -self.names.index(p)))
            out[lane] = Finding(lane, -ended(first), first, [], micro)
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
