"""The gradient noise scale from the lanes, against brute force.

- the estimator's algebra: unbiased for uneven shares and accumulated micro-batches (many synthetic
  draws of known ``G`` and ``Σ``), and exactly McCandlish et al.'s formulas for even shares;
- each strategy catches each lane's own gradient exactly: ``|h_i|²`` and ``|h|²`` equal a plain float64
  loop over the shards on one device, uneven shares and two micro-batches included;
- a real run (replicate, persistent) of linear regression, whose per-sample gradients are known in
  closed form, estimates ``|G|²``, ``tr Σ`` and ``B_simple`` within 10 % of the brute-force values.
"""

from __future__ import annotations

import math

import pytest
import torch
from multilane.engine.config import HealthSection
from multilane.engine.health.lane_grads import LaneGradProbe
from multilane.engine.health.monitor import ONE_DEVICE, HealthMonitor
from multilane.engine.health.noise_scale import LaneShares, NoiseScale, step_estimate
from multilane.engine.parallel import chunk_sizes, make_backend, make_strategy
from multilane.engine.parallel.timing import PhaseTimer
from multilane.engine.run.trainer import Trainer, TrainerCallback
from multilane.engine.tasks import ArrayData, Task
from multilane.engine.telemetry.devices import parse_devices
from torch import nn

F64 = torch.float64


@pytest.mark.slow
def test_the_estimator_is_unbiased_with_uneven_shares_and_micro_batches():
    g = torch.Generator().manual_seed(0)
    d, trials = 6, 40_000
    G = torch.randn(d, generator=g, dtype=F64)
    std = torch.rand(d, generator=g, dtype=F64) * 3
    micro = [[5, 2, 9], [4, 4, 1]]  # units per lane, two micro-batches of different sizes
    shares = LaneShares.empty(3)
    h = torch.zeros(trials, 3, d, dtype=F64)
    for sizes in micro:
        shares.add_micro(sizes, [0, 1, 2], accum=len(micro))
        for lane, n in enumerate(sizes):
            units = G + std * torch.randn(trials, n, d, generator=g, dtype=F64)
            h[:, lane] += units.sum(1) / (sum(sizes) * len(micro))
    lane_sq = h.square().sum(-1)
    total_sq = h.sum(1).square().sum(-1)
    # the estimate is linear in the squares: the mean of the trials' estimates is the estimate of their means
    g2, trace = step_estimate(lane_sq.mean(0).tolist(), float(total_sq.mean()), shares)
    one = step_estimate(lane_sq[0].tolist(), float(total_sq[0]), shares)
    assert one is not None and one != pytest.approx((g2, trace))  # one draw alone is noisy
    assert abs(g2 / G.square().sum().item() - 1) < 0.03
    assert abs(trace / std.square().sum().item() - 1) < 0.03


def test_even_shares_give_mccandlish_formulas_exactly():
    g = torch.Generator().manual_seed(1)
    k, B = 4, 32
    shares = LaneShares.empty(k)
    shares.add_micro([B // k] * k, list(range(k)), accum=1)
    means = torch.randn(k, 7, generator=g, dtype=F64)  # each lane's mean gradient
    big = means.mean(0)
    h = means / k
    g2, trace = step_estimate(h.square().sum(1).tolist(), big.square().sum().item(), shares)
    b_small, small_sq, big_sq = B / k, means.square().sum(1).mean().item(), big.square().sum().item()
    assert g2 == pytest.approx((B * big_sq - b_small * small_sq) / (B - b_small), rel=1e-12)
    assert trace == pytest.approx((small_sq - big_sq) / (1 / b_small - 1 / B), rel=1e-12)


def test_smoothing_averages_numerator_and_denominator_separately():
    ns = NoiseScale(decay=0.5)
    ns.add(1.0, 100.0)
    ns.add(3.0, 100.0)
    v = ns.value()
    # bias-corrected EMAs: (0.5*1 + 1*3)/1.5 and 100; B = 100 / that, not the mean of the two ratios
    assert v["g2"] == pytest.approx(3.5 / 1.5)
    assert v["b_simple"] == pytest.approx(100 / (3.5 / 1.5))


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 7, dtype=F64)
        self.b = nn.Linear(7, 3, dtype=F64)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


@pytest.mark.parametrize("strategy", ["replicate", "persistent"])
@pytest.mark.parametrize(("lanes", "weights"), [(2, None), (3, [3, 1, 2])])
def test_each_strategy_catches_each_lanes_own_gradient_exactly(strategy, lanes, weights):
    torch.manual_seed(0)
    model = Mlp()
    ref = Mlp()
    ref.load_state_dict(model.state_dict())
    backend = make_backend(parse_devices(",".join(f"cpu:{i}" for i in range(lanes))))
    strat = make_strategy(strategy, backend)
    probe = LaneGradProbe(lanes, torch.device("cpu"))
    strat.lane_grads = probe
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(n, 5, generator=g, dtype=F64), torch.randn(n, 3, generator=g, dtype=F64)) for n in (13, 9)]
    loss_fn = nn.functional.mse_loss
    try:
        for _ in range(2):  # the second step runs on replicas built at the first (persistent)
            probe.arm(accum=2)
            for p in model.parameters():
                p.grad = None
            for x, y in batches:
                out = strat.forward_loss(model, x, y, loss_fn, chunk_sizes(len(x), lanes, weights), PhaseTimer())
                strat.backward(out, out.loss / 2)
            strat.reduce_gradients(PhaseTimer())
            caught = probe.lane_squares().tolist()
            probe.disarm()
            # the plain loop: each lane's part of the batch's gradient, on one device
            expect, total = [], None
            for lane in range(lanes):
                ref.zero_grad()
                for x, y in batches:
                    sizes = chunk_sizes(len(x), lanes, weights)
                    lo = sum(sizes[:lane])
                    xs, ys = x[lo : lo + sizes[lane]], y[lo : lo + sizes[lane]]
                    if len(xs):
                        (loss_fn(ref(xs), ys) * len(xs) / len(x) / 2).backward()
                grads = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])
                expect.append(grads.square().sum().item())
                total = grads if total is None else total + grads
            assert caught == pytest.approx(expect, rel=1e-12)
            mine = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            assert torch.allclose(mine, total, rtol=1e-12, atol=0)
    finally:
        strat.close()
        backend.close()


# -- a real run against brute force ---------------------------------------------------------------
N, D = 4096, 8


class LinearRegression(Task):
    name = "linreg"

    def build_model(self):
        return nn.Linear(D, 1, dtype=F64)

    def data(self):
        g = torch.Generator().manual_seed(3)
        x = torch.randn(N, D, generator=g, dtype=F64) * torch.linspace(0.5, 2, D, dtype=F64)
        y = x @ torch.linspace(-1, 1, D, dtype=F64)[:, None] + 0.5 * torch.randn(N, 1, generator=g, dtype=F64) + 3
        return ArrayData(x, y), None

    def loss(self, output, target):
        return nn.functional.mse_loss(output, target)


def brute_force(model: nn.Linear, data: ArrayData) -> tuple[float, float]:
    """``|G|²`` and ``tr Σ`` over the whole training set, from every sample's exact gradient."""
    x, y = data.inputs, data.target
    r = 2 * (model(x) - y).detach()  # d(mse)/d(output) of one sample
    per_sample = torch.cat([r * x, r], dim=1)  # [dL/dw, dL/db]
    G = per_sample.mean(0)
    return G.square().sum().item(), (per_sample - G).square().sum(1).mean().item()


class Noise(TrainerCallback):
    def __init__(self) -> None:
        self.values: list[dict] = []

    def on_log(self, record: dict) -> None:
        if "noise" in record:
            self.values.append(record["noise"])


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "devices", "weights"), [("replicate", 2, None), ("persistent", 3, [3, 1, 2])])
def test_a_run_estimates_the_noise_scale_of_linear_regression_within_10_percent(
    make_config, strategy, devices, weights
):
    task = LinearRegression()
    cfg = make_config(
        devices__use=",".join(f"cpu:{i}" for i in range(devices)),
        devices__strategy=strategy,
        devices__weights=weights or [],
        train__steps=400,
        train__log_every=400,
        data__batch_size=64,
        optim__name="sgd",
        optim__lr=1e-12,  # the weights stay put: G and Σ are the same at every step
        health__every=1,
        health__noise_decay=0.995,
    )
    noise = Noise()
    trainer = Trainer(cfg, callbacks=[noise], task=task)
    assert trainer.run().status == "finished"
    g2, trace = brute_force(trainer.model, task.data()[0])
    got = noise.values[-1]
    assert got["batch"] == 64
    assert got["g2"] == pytest.approx(g2, rel=0.1)
    assert got["trace"] == pytest.approx(trace, rel=0.1)
    assert got["b_simple"] == pytest.approx(trace / g2, rel=0.1)


def test_one_device_says_why_there_is_no_noise_scale():
    mon = HealthMonitor(HealthSection(), 1, torch.device("cpu"))
    assert mon.probe is None
    assert mon.noise_note == ONE_DEVICE
    assert "two or more devices" in ONE_DEVICE
    assert math.isfinite(HealthSection().every)


def test_watch_prints_the_noise_scale_as_the_view_does():
    from multilane.engine.cli.watch import WatchState
    from multilane.engine.health.noise_scale import verdict

    state = WatchState()
    state.add({"kind": "train", "step": 50, "loss": 1.0, "noise": {"b_simple": 15.2, "batch": 64}})
    assert "noise scale ≈ 15 ·" in state.line() + " ·" and "15.2000" not in state.line()
    assert "noise scale ≈ 15:" in verdict(64, 15.2)
    state.add({"kind": "train", "step": 60, "loss": 1.0, "noise": {"b_simple": 1481.4, "batch": 64}})
    assert "noise scale ≈ 1,481" in state.line()
