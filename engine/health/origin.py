"""What a replayed step shows (nan_origin.py): the origin of a NaN, in one line.

The first non-finite value of the step — in the earliest micro-batch, and within it the input data,
then a module's output, then the loss, then a gradient — is the origin. Its samples:

1. the rows that hold the non-finite value, where they are few — at most a quarter of its device's rows
   (an eighth, when a layer's updates blew up in the steps before: many rows at once are the weights'
   doing, not theirs) — and the tensor has one row per sample (a sample-level fault: a NaN in the data,
   a module that makes inf from one sample);
2. otherwise (the loss, a gradient, many or every row at once, as after a layer that mixes the batch) the
   rows of that device whose values stand out at the first place they do (the input, then each module
   output with one row per sample, in the order they ran): a row's largest absolute value at least
   ``OUTLIER`` times the median row's of the whole micro-batch (every device's rows), or not finite where
   the median is — as few as in rule 1, counted over the micro-batch (a huge finite input that
   overflows later: in a later module, the loss or backward);
3. otherwise none: every sample went at once (an exploding learning rate), and the line says what the
   replayed steps before it did to the weights instead;
4. and then, when a layer's updates blew up at an earlier replayed step (below), the samples of that
   step's batch that stood out by rule 2 (every micro-batch, every device): a huge finite sample whose
   update wrecked the weights one step before anything went non-finite.

The updates: per layer (a module with parameters of its own), each replayed step's ``|Δw| / |w|``
(``w`` the weights the step started from; a layer of zeros has none) and weight norm. The layer that
blew up is the first whose ratio reached ``BLEW_UP`` (100× the ~1e-3 rule of thumb), at the earliest
step; ties in one step go to the largest ratio.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from multilane.engine.health.layers import _group_sq, param_layers
from multilane.engine.health.tracer import Finding
from multilane.engine.tensors.grads import local, norms
from torch import nn

MAX_SAMPLES = 8  # sample indices named in the one line (the detail file keeps up to MAX_DETAIL)
MAX_DETAIL = 1000
OUTLIER = 1000.0
BLEW_UP = 0.1
SHOWN_STEPS = 6  # the last steps whose ratios the line lists
SHOWN_LAYERS = 4  # the layers whose last ratio the line lists, largest first
RAW = "_raw"  # the updates' values as they are (inf, NaN), for the line; not written to the detail


@dataclass
class Origin:
    step: int
    kind: str  # "input", "output", "loss", "gradient", "weights"
    where: str
    device: str
    samples: list[int]
    gradient: tuple[str, str] | None  # (parameter, device)
    loss: float | None
    detail: dict[str, Any]
    standout: str | None = None  # the module (or the input) where the samples named by size stand out
    updates: str = ""  # what the replayed steps before did to the weights (origin.py's docstring)
    layer: str | None = None  # the layer whose update ratio blew up first, if one did
    samples_step: int | None = None  # the earlier step whose batch ``samples`` are from (rule 4), if not ``step``

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
        if self.samples and self.samples_step is None:
            text += ", from " + self._samples()
        # a non-finite loss makes every gradient non-finite: naming one adds nothing (and only the ranks'
        # replays, which see each rank's own backward, would name it: one line for every strategy)
        if self.gradient is not None and self.kind not in ("gradient", "loss"):
            text += f"; first non-finite gradient in {self.gradient[0]} on {self.gradient[1]}"
        text += self.updates
        if self.samples and self.samples_step is not None:
            text += f"; step {self.samples_step}'s batch held " + self._samples()
        return text

    def _samples(self) -> str:
        more = len(self.samples) - MAX_SAMPLES
        text = "samples " + ", ".join(str(s) for s in self.samples[:MAX_SAMPLES])
        text += f" and {more} more" if more > 0 else ""
        if self.standout is not None:
            text += f" (standing out in {self.standout}: ≥{OUTLIER:g}× the batch's median |value|)"
        return text


def first(found: dict[int, Finding]) -> Finding | None:
    return min(found.values(), key=lambda f: (f.micro, f.seq, f.lane)) if found else None


# -- the updates before it ---------------------------------------------------------------------------
class UpdateTrail:
    """Per layer, each replayed step's squared weight norm before and after the update and ``|Δw|²``
    (device tensors; the optimizer's own step hooks, so every strategy's update is seen; under fsdp
    over this rank's shards, summed over the ranks by the caller)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.names, owner, self.params = param_layers(model)
        device = self.params[0].device if self.params else torch.device("cpu")
        self.owner = torch.tensor(owner, dtype=torch.long, device=device)
        self.step = 0
        self.steps: list[tuple[int, torch.Tensor]] = []  # (step, [3, layers]: w0², Δw², w1²)
        self._before: list[torch.Tensor] | None = None
        self._handles = [optimizer.register_step_pre_hook(self._pre), optimizer.register_step_post_hook(self._post)]

    def _pre(self, *_: Any) -> None:
        if self.params:
            self._before = torch._foreach_mul([local(p.detach()) for p in self.params], 1.0)

    def _post(self, *_: Any) -> None:
        if self._before is None:
            return
        now = [local(p.detach()) for p in self.params]
        n = len(self.names)
        w0 = _group_sq(norms(self._before), self.owner, n)
        torch._foreach_sub_(self._before, now)
        du = _group_sq(norms(self._before), self.owner, n)
        self._before = None
        self.steps.append((self.step, torch.stack([w0, du, _group_sq(norms(now), self.owner, n)])))

    def take(self) -> list[tuple[int, list[list[float]]]]:
        """The steps kept so far, read (one transfer), then forgotten."""
        steps, self.steps = self.steps, []
        if not steps:
            return []
        values = torch.stack([v for _, v in steps]).tolist()
        return [(s, v) for (s, _), v in zip(steps, values, strict=True)]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def updates_before(names: list[str], steps: list[tuple[int, list[list[float]]]], step: int) -> dict[str, Any] | None:
    """The replayed steps before ``step``: per layer, their update ratios and weight norms, and the layer
    that blew up first (None: no replayed step before it)."""
    before = [(s, v) for s, v in steps if s < step]
    if not before or not names:
        return None
    ratios = [[_ratio(w0, du) for w0, du in zip(v[0], v[1], strict=True)] for _, v in before]
    weights = [[math.sqrt(w) if w == w else math.nan for w in v[2]] for _, v in before]
    blew = None
    for (s, _), row in zip(before, ratios, strict=True):
        over = [(r, k) for k, r in enumerate(row) if r is not None and (r >= BLEW_UP or r != r)]
        if over:
            r, k = max(over, key=lambda x: (x[0] if x[0] == x[0] else math.inf, -x[1]))
            blew = {"layer": names[k], "step": s, "ratio": r}
            break
    if blew is not None:
        blew["ratio"] = _json(blew["ratio"])
    return {
        "steps": [s for s, _ in before],
        "layers": names,
        "update_ratio": [[_json(r) for r in row] for row in ratios],  # JSON: None where not finite
        "weight_norm": [[_json(w) for w in row] for row in weights],
        "blew_up": blew,
        RAW: (ratios, weights),  # the values as they are, for the line (popped before the detail is written)
    }


def _ratio(w0: float, du: float) -> float | None:
    if not w0 > 0 or math.isinf(w0):
        return None
    return math.sqrt(du / w0) if du == du else math.nan


def _json(v: float | None) -> float | None:
    return None if v is None or not math.isfinite(v) else float(f"{v:.4g}")


def _g(v: float | None) -> str:
    return "—" if v is None else "nan" if v != v else "inf" if math.isinf(v) else f"{v:.2g}"


def updates_text(u: dict[str, Any], named_samples: bool) -> tuple[str, str | None]:
    """The line's part on the updates before the origin, and the layer that blew up (or None). With
    samples named and no layer blown up it says nothing (the steps before were ordinary)."""
    names, steps = u["layers"], u["steps"]
    blew = u["blew_up"]
    span = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}–{steps[-1]}"
    if blew is None:
        if named_samples:
            return "", None
        last = u[RAW][0][-1]
        known = [(r, k) for k, r in enumerate(last) if r is not None and r == r]
        if not known:
            return "", None
        r, k = max(known)
        return (
            f"; before it ({span}) every layer's |Δw|/|w| stayed under {BLEW_UP:g} (largest: {names[k]}, {_g(r)})",
            None,
        )
    ratios, weights = u[RAW]
    k, i0 = names.index(blew["layer"]), max(0, len(steps) - SHOWN_STEPS)  # the last steps' values
    shown = " → ".join(_g(row[k]) for row in ratios[i0:])
    span = f"step {steps[i0]}" if i0 == len(steps) - 1 else f"steps {steps[i0]}–{steps[-1]}"
    text = (
        f"; before it |Δw|/|w| of {blew['layer']} passed {BLEW_UP:g} first, at step {blew['step']}"
        f" ({span}: {shown}), its weight norm {_g(weights[i0][k])} → {_g(weights[-1][k])}"
    )
    if len(names) > 1:  # the other layers: the largest ratios of the last step before it
        last = sorted(((r if r == r else math.inf, j) for j, r in enumerate(ratios[-1]) if r is not None), reverse=True)
        top = ", ".join(f"{names[j]} {_g(ratios[-1][j])}" for _, j in last[:SHOWN_LAYERS])
        text += f"; step {steps[-1]}'s |Δw|/|w| by layer: {top}" + (" …" if len(last) > SHOWN_LAYERS else "")
    return text, blew["layer"]


# -- the samples -----------------------------------------------------------------------------------
def outlier_rows(
    peaks: dict[tuple[int, str], dict[int, Any]], micro: int, lane: int, share: int = 4
) -> tuple[list[int], str | None]:
    """Rule 2 of the module docstring: the rows of ``lane`` in micro-batch ``micro`` that stand out at the
    first place (in the order it ran: the input, then the modules' outputs) where any does, and that place;
    at most ``1/share`` of the micro-batch's rows stand out."""
    for (m, name), by_lane in peaks.items():
        if m != micro or lane not in by_lane:
            continue
        values = {k: torch.as_tensor(v, dtype=torch.float64).cpu().nan_to_num(nan=math.inf) for k, v in by_lane.items()}
        every = torch.cat([values[k] for k in sorted(values)])
        median = float(torch.median(every))
        if not math.isfinite(median):
            continue
        mine = values[lane]
        flagged = ~torch.isfinite(mine) if median <= 0 else mine >= OUTLIER * median
        found = torch.nonzero(flagged).reshape(-1).tolist()
        if found and share * len(found) <= len(every):
            return found, name
    return [], None


Samples = Callable[[int, int, list[int]], list[int]]
"""The dataset indices of some rows of a lane's shard of a global micro-batch (``sample_namer``)."""


def sample_namer(loader: Any, sizes: Callable[[int], list[int]]) -> Samples:
    """``Samples`` of ``loader`` (its ``sample_indices``, where it has them), split as ``sizes`` splits a batch."""

    def samples(micro: int, lane: int, rows: list[int]) -> list[int]:
        indices = loader.sample_indices(micro) if hasattr(loader, "sample_indices") and rows else None
        if not indices:
            return []
        shares = sizes(len(indices))
        lo = sum(shares[:lane])
        return [indices[lo + r] for r in rows if r < shares[lane] and lo + r < len(indices)]

    return samples


def _rows_of(
    found: Finding, peaks: dict[tuple[int, str], dict[int, Any]], blew_up: bool
) -> tuple[list[int], str | None]:
    """The rows that name ``found``'s samples (rules 1 and 2), and where they stand out (rule 2): a few
    rows (a quarter of them; an eighth after a layer blew up)."""
    share = 8 if blew_up else 4
    shard, n = found.shard, len(found.rows)
    per_sample = shard is not None and found.span == shard
    if per_sample and 0 < n < shard and n <= max(1, shard // share):
        return found.rows, None
    return outlier_rows(peaks, found.micro, found.lane, share)


PHASES = ("input", "output", "loss", "gradient")


def origin_of(
    samples_of: Samples,
    step: int,
    tracer: Any,
    rec: dict[str, Any] | None,
    k0: int,
    names: list[str],
    updates: list[tuple[int, list[list[float]]]] | None = None,
    layers: list[str] | None = None,
    history: dict[int, dict[tuple[int, str], dict[int, Any]]] | None = None,
) -> Origin | None:
    """The origin a replayed step shows (``samples_of`` names its rows' samples), from its findings per lane (``tracer``: ``inputs``, ``outputs``,
    ``losses``, ``grads``, ``peaks``; under ddp a rank is a lane) and its record (its loss, when not
    finite, goes into the origin's line), or None when every value stayed finite. ``updates``: the
    replayed steps' per-layer sums (``UpdateTrail.take``) of ``layers``; ``history``: the earlier
    replayed steps' ``peaks``, by step (rule 4)."""
    loss = rec["loss"] if rec else math.nan
    loss = None if math.isfinite(loss) else loss
    bad_lanes = [k for k, v in (rec or {}).get("device_loss", {}).items() if not math.isfinite(v)]
    found_by = dict(zip(PHASES, (tracer.inputs, tracer.outputs, tracer.losses, tracer.grads), strict=True))
    firsts = [(f.micro, i, kind, f) for i, (kind, d) in enumerate(found_by.items()) if (f := first(d)) is not None]
    if not firsts and not bad_lanes:
        return None
    first_grad = first(tracer.grads)
    grad = (first_grad.where, names[first_grad.lane]) if first_grad is not None else None
    u = updates_before(layers or [], updates or [], step)
    blew_up = u is not None and u["blew_up"] is not None
    if firsts:
        _, _, kind, f = min(firsts, key=lambda x: (x[0], x[1], x[3].seq, x[3].lane))
        rows, standout = _rows_of(f, tracer.peaks, blew_up)
        samples = samples_of(f.micro, f.lane, rows)
        where, device, micro = f.where, names[f.lane], f.micro
    else:  # the combined loss, with every lane's finite (a weighted sum that overflowed)
        kind, where, device, samples, standout, micro = "loss", "the loss", bad_lanes[0], [], None, None
    detail = {
        "step": step,
        "micro_batch": micro,
        "inputs": {names[f.lane]: f.rows[:MAX_DETAIL] for f in tracer.inputs.values()},
        "outputs": {names[f.lane]: {"module": f.where, "rows": f.rows[:MAX_DETAIL]} for f in tracer.outputs.values()},
        "gradients": {names[f.lane]: f.where for f in tracer.grads.values()},
        "device_loss": (rec or {}).get("device_loss"),
        "samples": samples[:MAX_DETAIL],
        "replayed_from_step": k0,
    }
    origin = Origin(step, kind, where, device, samples, None if kind == "gradient" else grad, loss, detail, standout)
    if u is None and not samples and kind != "input":  # nothing to show of the updates: say why
        origin.updates = f"; no update replayed before it (the replay began at step {step})"
    if u is not None:
        detail["updates"] = u
        origin.updates, origin.layer = updates_text(u, bool(samples))
        del u[RAW]
        blew = u["blew_up"]
        if blew is not None and not samples and history and blew["step"] in history:
            found, standout = step_outliers(samples_of, history[blew["step"]])
            if found:
                origin.samples, origin.standout, origin.samples_step = found, standout, blew["step"]
                detail["samples"], u["samples"] = found[:MAX_DETAIL], found[:MAX_DETAIL]
    return origin


def step_outliers(samples_of: Samples, peaks: dict[tuple[int, str], dict[int, Any]]) -> tuple[list[int], str | None]:
    """Rule 2 over a whole step (every micro-batch, every device): the samples that stand out, and where
    they first do."""
    found: list[int] = []
    where = None
    for micro in sorted({m for m, _ in peaks}):
        for lane in sorted({k for (m, _), by in peaks.items() if m == micro for k in by}):
            rows, w = outlier_rows(peaks, micro, lane)
            if rows:
                found += samples_of(micro, lane, rows)
                where = where or w
    return found, where
