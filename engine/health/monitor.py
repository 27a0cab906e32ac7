"""The run's health, sampled every ``health.every`` steps: the trainer's one object for it.

The trainer calls, on every step, ``begin_step`` → ``micro`` (per micro-batch) → ``after_reduce``
(the model's ``.grad`` is the batch's) → ``before_update`` → the optimizer steps → ``after_update``;
each is a flag test on a step that is neither sampled nor measured. On a sampled step the per-layer
values (layers.py) are computed on the device; on about one step in ``health.noise_every`` (with two
or more devices; ``noise_scale.measured``) each lane's squared gradient norm and the combined one (lane_grads.py), kept on the
device. ``at_log`` reads every such step of the log window in one transfer, adds each measured step's
estimate to the run's noise scale (noise_scale.py) and returns it for the train record, with one
``health`` record per sampled step.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from multilane.engine.health.groups import add_by_group, group_rows
from multilane.engine.health.lane_grads import LaneGradProbe, squared_norm
from multilane.engine.health.layers import LayerSample, activation_values, layer_values
from multilane.engine.health.noise_scale import LaneShares, NoiseScale, measured, step_estimate
from torch import nn

SHARDED_SUMS = ("act", "grad_sq", "total_sq", "update_sq", "weight_sq")
"""A sampled step's sums that fsdp's ranks each hold a part of (their own shards, their own samples)."""
RANK_SUMS = ("act",)
"""Those that ddp's ranks each hold a part of: the activations of their own samples (their gradients
and weights are the same on every rank once DDP has averaged the gradients)."""
ONE_DEVICE = "the noise scale needs two or more devices: it compares each device's gradient with the combined one"


def _round(v: float | None) -> float | None:
    """4 significant digits: the records stay small (a heatmap needs no more)."""
    if v is None or not math.isfinite(v):
        return None
    return float(f"{v:.4g}")


class HealthMonitor:
    """Samples per-layer health and the lanes' gradients on every ``every``-th step."""

    def __init__(
        self,
        cfg: Any,
        lanes: int,
        device: torch.device,
        unit: str = "samples",
        exchange: Callable[[torch.Tensor], None] | None = None,
        sharded: bool = False,
    ) -> None:
        self.cfg = cfg
        self.sharded = sharded
        """fsdp: each rank's per-layer sums are over its own shards (and its activations over its own
        part of the batch): ``exchange`` adds them over the ranks at log time, with the lanes' entries."""
        self.every = cfg.every if cfg.enabled else 0
        self.noise_every = getattr(cfg, "noise_every", 1) if cfg.enabled else 0
        self.lanes = lanes
        self.device = device
        self.unit = unit
        self.exchange = exchange
        """ddp: sums a vector over the ranks in place (each rank fills its own lane's entries)."""
        self.probe = LaneGradProbe(lanes, device, always=exchange is not None) if lanes > 1 and self.every else None
        self.noise = NoiseScale(cfg.noise_decay)
        self.kinds = [k for k in cfg.activations.split(",") if k.strip()]
        self.layers: LayerSample | None = None
        self._rows: tuple[list[str], list[int]] | None = None
        self._act_rows: tuple[list[str], list[int]] | None = None
        self.on = False
        """This step is sampled or measured (between ``begin_step`` and ``after_update``)."""
        self._sampled = False  # this step's per-layer values are taken
        self._step = 0
        self._shares = LaneShares.empty(lanes)
        self._handles: list[Any] = []
        self._pending: list[tuple[int, dict[str, torch.Tensor], LaneShares, bool]] = []
        self._noise_tensors: dict[str, torch.Tensor] = {}
        self.off_note: str | None = None  # why the noise scale is off in a run where it could be measured
        self.idle = range(0)
        """Steps at which ``begin_step`` would do nothing (up to the next sampled or measured one): the
        loop skips the call on them (``step in idle`` costs no Python call)."""
        self.muted = False
        """Steps that are not the run's own (a NaN's replay): none sampled, none measured for the noise
        scale (its probe stays unarmed, whatever feeds it: under ddp and fsdp the gradients' collective)."""

    @property
    def noise_note(self) -> str | None:
        """Why the noise scale is not measured in this run, or None."""
        return ONE_DEVICE if self.every and self.lanes < 2 else None

    # -- the step ---------------------------------------------------------------------------------
    def begin_step(self, step: int, model: nn.Module, accum: int, replicas: Sequence[nn.Module] | None = ()) -> None:
        """Before step ``step`` (1-based): arm the sampling if this step is sampled, the lanes' probe if
        it is measured. ``replicas``: the strategy's own copies of the model (persistent), whose hooks
        are their own; None while they are still to be made (that step samples no activations: a copy
        made then would keep the hooks)."""
        if self.muted:
            return
        sampled = bool(self.every) and step % self.every == 0
        noise = self.probe is not None and measured(step, self.noise_every)
        self.idle = range(step + 1, self._next_due(step))
        if not (sampled or noise):
            return
        self.on, self._sampled, self._step = True, sampled, step
        self._shares = LaneShares.empty(self.lanes)
        if self.probe is not None:
            self.probe.arm(accum)
        if not sampled:
            return
        if self.layers is None:
            # every rank sends its activations' sums, zeros where it saw none (an empty shard)
            self.layers = LayerSample(model, self.kinds, self.device, always_act=self.exchange is not None)
        self.layers.reset()
        # replicate's replicas share the model's hooks; persistent's own copies need their own
        if replicas is not None:
            targets = [model, *[r for r in replicas if r is not model]]
            self._handles = self.layers.hook_activations(targets)

    def _next_due(self, step: int) -> int:
        """The first step after ``step`` that may be sampled or measured (looked for a bounded way ahead:
        ``begin_step`` looks again from there)."""
        if not self.every:
            return sys.maxsize
        end = (step // self.every + 1) * self.every  # the next sampled step
        if self.probe is not None:
            end = min(end, step + 1 + 4 * max(1, self.noise_every))
            return next((s for s in range(step + 1, end) if measured(s, self.noise_every)), end)
        return end

    @contextlib.contextmanager
    def no_activations(self) -> Iterator[None]:
        """A forward whose outputs are not the batch's (a rank whose shard is empty runs the model on a
        stand-in sample): its activations are not counted."""
        if self.layers is None:
            yield
            return
        self.layers.paused = True
        try:
            yield
        finally:
            self.layers.paused = False

    def micro(self, lane_units: Sequence[float], lanes: Sequence[int], accum: int, total: float | None = None) -> None:
        """One micro-batch: how many units (samples, or loss weight) each lane in ``lanes`` carried
        (``total``: the micro-batch's, where ``lanes`` are not all of them)."""
        if self.on:
            self._shares.add_micro(lane_units, lanes, accum, total)

    def after_reduce(
        self, model: nn.Module, scale: torch.Tensor | None, lane_scale: torch.Tensor | float | None = None
    ) -> None:
        """The model's ``.grad`` is the batch's gradient (before clipping; ``scale``: fp16's loss scale,
        None where it is already unscaled). ``lane_scale``: the scale the lanes' own gradients carry
        where it differs (an outside loop that unscales ``.grad`` before its hook, after its comm hook
        saw the scaled buckets); by default ``scale``."""
        if not self.on:
            return
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._sampled:
            assert self.layers is not None
            self.layers.gradients(scale)
        out: dict[str, torch.Tensor] = {}
        if self.probe is not None:
            lane_sq = self.probe.lane_squares()
            if lane_sq is not None:
                grads = [p.grad for p in model.parameters() if p.grad is not None]  # sparse, DTensor: squared_norm
                total = squared_norm(grads, self.device)
                if scale is not None:
                    total = total / scale.to(self.device, torch.float64).square()
                lane_scale = scale if lane_scale is None else lane_scale
                if lane_scale is not None:
                    lane_sq = lane_sq / torch.as_tensor(lane_scale, dtype=torch.float64, device=self.device).square()
                out["lane_sq"], out["total_sq"] = lane_sq, total.reshape(1)
            self.probe.disarm()
        self._noise_tensors = out

    def before_update(self) -> None:
        if self._sampled and self.layers is not None:
            self.layers.before_update()

    def after_update(self) -> None:
        if not self.on:
            return
        tensors = dict(self._noise_tensors)
        if self._sampled:
            assert self.layers is not None
            self.layers.after_update()
            tensors |= self.layers.tensors()
        if tensors:
            self._pending.append((self._step, tensors, self._shares, self._sampled))
        self._noise_tensors = {}
        self.on = self._sampled = False

    def abandon(self) -> None:
        """A step that failed part way: drop what it armed."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if self.probe is not None:
            self.probe.disarm()
        self._noise_tensors = {}
        self.on = self._sampled = False

    # -- log time ---------------------------------------------------------------------------------
    def at_log(
        self, wall_time: float | None = None, read: bool = True
    ) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
        """``(noise, records)``: the run's noise scale for the train record (None if not measured)
        and one ``health`` record per sampled step of the window (grouped rows; its ``layers`` holds
        every layer's values, for the run folder's ``health_layers.jsonl``). The window's one read of
        the device. ``read=False`` (an outside loop that calls this every step): the measured steps
        stay on the device until a sampled step is pending (every rank alike: a ddp read is a collective)."""
        if not read and not any(sampled for *_, sampled in self._pending):
            return self._noise_value(), []
        pending, self._pending = self._pending, []
        if not pending:
            return self._noise_value(), []
        if self.exchange is not None:
            self._exchange(pending)
        keys = [sorted(t) for _, t, _, _ in pending]
        flat = [
            t[k].reshape(-1).to(self.device, torch.float64)
            for (_, t, _, _), ks in zip(pending, keys, strict=True)
            for k in ks
        ]
        values = torch.cat(flat).tolist() if flat else []
        records, at = [], 0
        wall = time.time() if wall_time is None else wall_time
        for (step, tensors, shares, sampled), ks in zip(pending, keys, strict=True):
            sums: dict[str, list[float]] = {}
            for k in ks:
                n = tensors[k].numel()
                sums[k] = values[at : at + n]
                at += n
            if "lane_sq" in sums:
                est = step_estimate(sums["lane_sq"], sums["total_sq"][0], shares)
                if est is not None:
                    self.noise.add(*est, weight=shares.units)
            if sampled:
                records.append(self._record(step, sums, wall))
        return self._noise_value(), records

    def _exchange(self, pending: list[tuple[int, dict[str, torch.Tensor], LaneShares, bool]]) -> None:
        """ddp, fsdp: every rank's lane entries and shares, its activations' sums (and under fsdp its
        sums over its own shards) summed over the ranks (one collective)."""
        n = self.lanes
        summed = SHARDED_SUMS if self.sharded else RANK_SUMS
        parts = []
        for _, t, sh, _ in pending:
            parts += [t[k].reshape(-1).to(self.device, torch.float64) for k in sorted(t) if k in summed]
            if "lane_sq" in t:
                parts += [t["lane_sq"], torch.tensor([*sh.a, *sh.q, sh.units], dtype=torch.float64, device=self.device)]
        if not parts:
            return
        pack = torch.cat(parts)
        self.exchange(pack)
        at = 0
        for _, t, sh, _ in pending:
            for k in [k for k in sorted(t) if k in summed]:
                size = t[k].numel()
                t[k] = pack[at : at + size].reshape(t[k].shape)
                at += size
            if "lane_sq" in t:
                t["lane_sq"] = pack[at : at + n]
                vals = pack[at + n : at + 3 * n + 1].tolist()
                sh.a, sh.q, sh.units = vals[:n], vals[n : 2 * n], vals[2 * n]
                at += 3 * n + 1

    def _noise_value(self) -> dict[str, Any] | None:
        """The train record's ``noise``: ``g2``, ``trace``, ``b_simple``, its band ``lo``–``hi``, the
        measured ``steps``, the steps' mean ``batch`` and the ``unit`` both count."""
        v = self.noise.value()
        if v is None:
            return None
        return {k: _round(x) if k != "steps" else x for k, x in v.items()} | {"unit": self.unit}

    def _record(self, step: int, sums: dict[str, list[float]], wall: float) -> dict[str, Any]:
        """One ``health`` record: the grouped rows (the full per-layer list is ``layers``)."""
        assert self.layers is not None
        names = self.layers.names
        if self._rows is None:
            self._rows = group_rows(names, self.cfg.groups)
        groups, of = self._rows
        rec: dict[str, Any] = {"kind": "health", "step": step, "wall_time": wall, "rows": groups}
        grouped = {
            k: add_by_group(sums[k], of, len(groups)) for k in ("grad_sq", "weight_sq", "update_sq") if k in sums
        }
        for k, v in layer_values(groups, grouped).items():
            rec[k] = [_round(x) for x in v]
        full = layer_values(names, sums)
        if "act" in sums:
            act_names = [f"{n} ({kind})" for n, kind in self.layers.act_names]
            if self._act_rows is None:
                self._act_rows = group_rows(act_names, self.cfg.groups)
            agroups, aof = self._act_rows
            rows4 = [sums["act"][4 * i : 4 * i + 4] for i in range(len(act_names))]
            summed = [[0.0] * 4 for _ in agroups]
            for r, g in zip(rows4, aof, strict=True):
                summed[g] = [a + b for a, b in zip(summed[g], r, strict=True)]
            rec["act_rows"] = agroups
            for k, v in activation_values(summed).items():
                rec[k] = [_round(x) for x in v]
            full |= {k: v for k, v in activation_values(rows4).items()}
            full["act_rows"] = act_names
        rec["layers"] = {
            "step": step,
            "names": names,
            **{k: [_round(x) if isinstance(x, float) else x for x in v] for k, v in full.items()},
        }
        return rec

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"noise": self.noise.state_dict()}

    def load_state_dict(self, state: Any) -> None:
        if isinstance(state, dict):
            self.noise.load_state_dict(state.get("noise"))
