"""A data-parallel step equals a plain single-device loop for the models people really train.

Each kind of tests/exactness_kinds.py trains on 1, 2 and 3 CPU lanes, with even and uneven splits, in
float64, through the public engine API (``make_backend`` + ``ReplicateEachStep``), and is compared with a
hand-written full-batch loop: every step's loss, every step's gradients (``None`` where the loop has
none), and the final parameters and buffers. ``python tests/test_exactness.py`` prints the maxima.
"""

from __future__ import annotations

import math
import sys
from functools import cache
from pathlib import Path

import pytest
import torch
from multilane.engine.parallel import ReplicateEachStep, chunk_sizes, make_backend
from multilane.engine.parallel.lane_loss import model_args
from multilane.engine.parallel.timing import PhaseTimer
from multilane.engine.telemetry.devices import parse_devices

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/, where exactness_kinds.py is
from exactness_kinds import KINDS, Kind

BOUND = 1e-10
SPLITS = {
    "1 lane": (1, None),
    "2 even": (2, None),
    "2 [1,3]": (2, [1, 3]),
    "3 even": (3, None),
    "3 [3,1,2]": (3, [3, 1, 2]),
}


def lanes(n: int):
    return parse_devices(",".join(f"cpu:{i}" for i in range(n)))


def train(kind: Kind, step_fn) -> dict:
    """Train ``kind`` with ``step_fn(model, inputs, target) -> loss`` as the forward; record everything."""
    model = kind.model()
    opt = kind.optimizer(model.parameters())
    losses, grads = [], []
    batches = kind.batches
    for step in range(len(batches) // kind.accum):
        opt.zero_grad(set_to_none=True)
        for k in range(kind.accum):
            inputs, target = batches[step * kind.accum + k]
            loss = step_fn(model, inputs, target)
            (loss / kind.accum if kind.accum > 1 else loss).backward()
            losses.append(loss.detach())
        if kind.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), kind.clip)
        grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
        opt.step()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "grads": grads, "state": state}


@cache
def reference(name: str) -> dict:
    """The plain loop a user writes for one device: the whole batch, forward, loss, backward, step."""
    kind = KINDS[name]

    def full_batch(model, inputs, target):
        args, kwargs = model_args(inputs)
        return kind.loss(model(*args, **kwargs), target)

    return train(kind, full_batch)


def on_lanes(name: str, n: int, weights: list[int] | None) -> dict:
    kind = KINDS[name]
    backend = make_backend(lanes(n))
    strategy = ReplicateEachStep(backend)
    timer = PhaseTimer()

    def step(model, inputs, target):
        sizes = chunk_sizes(len(target[0] if isinstance(target, tuple) else target), n, weights)
        return strategy.forward_loss(model, inputs, target, kind.loss, sizes, timer, weight_fn=kind.weight).loss

    try:
        return train(kind, step)
    finally:
        backend.close()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|; infinite where a holds a NaN that b does not."""
    if a.dtype == torch.bool or not a.is_floating_point():
        return 0.0 if torch.equal(a, b) else math.inf
    if not b.numel():
        return 0.0
    d = ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()
    return math.inf if math.isnan(d) else d


def max_differences(got: dict, ref: dict) -> dict[str, float]:
    """Largest relative difference of the losses, gradients, and final parameters and buffers."""
    assert len(got["losses"]) == len(ref["losses"])
    out = {"loss": max(rel(a, b) for a, b in zip(got["losses"], ref["losses"], strict=True))}
    g = 0.0
    for step_got, step_ref in zip(got["grads"], ref["grads"], strict=True):
        for a, b in zip(step_got, step_ref, strict=True):
            assert (a is None) == (b is None), "a parameter's gradient is None on one side only"
            if a is not None:
                g = max(g, rel(a, b))
    out["grad"] = g
    assert got["state"].keys() == ref["state"].keys()
    out["state"] = max(rel(got["state"][k], ref["state"][k]) for k in ref["state"])
    return out


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("name", list(KINDS))
def test_lanes_equal_a_plain_full_batch_loop(name, split):
    n, weights = SPLITS[split]
    diffs = max_differences(on_lanes(name, n, weights), reference(name))
    assert all(math.isfinite(v) for v in diffs.values()), diffs
    assert max(diffs.values()) <= BOUND, diffs


def maxima_table() -> str:
    """The table in docs/design.md: per kind, the largest relative difference over all splits."""
    rows = ["| model kind | loss | gradients | parameters, buffers |", "| --- | --- | --- | --- |"]
    for name in KINDS:
        worst = {"loss": 0.0, "grad": 0.0, "state": 0.0}
        for n, weights in SPLITS.values():
            for k, v in max_differences(on_lanes(name, n, weights), reference(name)).items():
                worst[k] = max(worst[k], v)
        rows.append(f"| {name} | {worst['loss']:.1e} | {worst['grad']:.1e} | {worst['state']:.1e} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(maxima_table())
