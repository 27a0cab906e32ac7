"""The gradient noise scale from the lanes, against brute force.

- the estimator's algebra: unbiased for uneven shares and accumulated micro-batches (many synthetic
  draws of known ``G`` and ``Σ``), and exactly McCandlish et al.'s formulas for even shares;
- each strategy catches each lane's own gradient exactly: ``|h_i|²`` and ``|h|²`` equal a plain float64
  loop over the shards on one device, uneven shares and two micro-batches included;
- the run's average and its band: the weighted means of the steps' estimates, and a 95 % band that
  holds the true ratio in ~95 % of many synthetic runs (brute force: the runs themselves);
- a DEFAULT run (the health section as shipped) of a float64 MLP on uneven lanes shows a value within
  30 % of brute force (every training sample's own gradient) and a band that holds it;
- the verdict: only where the band is clear of the batch, else "not yet known"; the unit beside it.
"""

from __future__ import annotations

import math

import pytest
import torch
from multilane.engine.config import HealthSection
from multilane.engine.health.lane_grads import LaneGradProbe
from multilane.engine.health.monitor import ONE_DEVICE, HealthMonitor
from multilane.engine.health.noise_scale import LaneShares, NoiseScale, measured, step_estimate, verdict
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


def test_the_average_weights_each_step_by_its_batch_and_its_band_covers_the_truth():
    ns = NoiseScale(decay=1.0)
    for g2, trace, w in [(1.0, 100.0, 64), (3.0, 50.0, 64), (2.0, 80.0, 16)]:
        ns.add(g2, trace, w)
    v = ns.value()
    assert v["g2"] == pytest.approx((64 * 1 + 64 * 3 + 16 * 2) / 144)
    assert v["trace"] == pytest.approx((64 * 100 + 64 * 50 + 16 * 80) / 144)
    assert v["b_simple"] == pytest.approx(v["trace"] / v["g2"])  # the ratio of the averages
    assert v["steps"] == 3 and v["batch"] == pytest.approx(48)
    # Many synthetic runs of 300 steps (per-step estimates as scattered as a real run's, |G|² often < 0
    # alone, correlated with tr Σ, a short batch now and then): the band holds the truth ~95 % of runs.
    rng = torch.Generator().manual_seed(5)
    G, T, runs, held, widths = 2.0, 60.0, 200, 0, []
    for _ in range(runs):
        ns = NoiseScale(decay=0.99)
        z = torch.randn(300, 2, generator=rng, dtype=F64).tolist()
        for k, (a, b) in enumerate(z):
            w = 64 if k % 7 else 16
            s = (64 / w) ** 0.5
            ns.add(G + 4.0 * s * a, T + 40.0 * s * (0.6 * a + 0.8 * b), w)
        v = ns.value()
        lo, hi = v["lo"], v["hi"]
        held += lo is not None and lo <= T / G <= hi
        widths.append((hi - lo) / (T / G) if lo is not None else math.inf)
    assert 0.9 <= held / runs <= 0.99, held
    assert sorted(widths)[runs // 2] < 0.8  # and it is not trivially wide
    # few steps, |G|² not clear of zero: no band
    ns = NoiseScale()
    for g2 in (5.0, -4.0, 0.5):
        ns.add(g2, 50.0, 64)
    assert ns.value()["lo"] is None and ns.value()["hi"] is None
    # a checkpoint carries the sums; one written before the band starts afresh
    again = NoiseScale()
    again.load_state_dict(ns.state_dict())
    assert again.value() == ns.value()
    again.load_state_dict({"g2": 1.0, "trace": 2.0, "weight": 0.5, "samples": 3})
    assert again.value() == ns.value()


def test_the_measured_steps_line_up_with_no_period_of_the_run():
    # about one step in 4, and at every place of an epoch of 2 to 12 steps: 4-step epochs measured at
    # every 4th step would see only their (short) last batches
    steps = [s for s in range(1, 4801) if measured(s, 4)]
    assert 0.23 < len(steps) / 4800 < 0.27
    for period in range(2, 13):
        at = [sum(1 for s in steps if s % period == k) for k in range(period)]
        assert min(at) > 0.6 * len(steps) / period, (period, at)
    assert all(measured(s, 1) for s in range(1, 50))


def test_the_verdict_is_given_only_when_the_band_is_clear_of_the_batch():
    assert "would still help" in verdict(64, 500, "samples", 300, 900)
    assert "past the noise scale" in verdict(64, 10, "samples", 6, 20)
    assert "near the noise scale" in verdict(64, 60, "samples", 40, 100)
    held = verdict(64, 70, "samples", 20, 300)
    assert held.startswith("batch 64 samples · noise scale ≈ 70 samples (95 % band 20–300)")
    assert "not yet known" in held and "help:" not in held
    assert "not yet known" in verdict(64, 70, "samples", None, None)
    assert verdict(248, 1481.4, "tokens", 1200, 1800).startswith("batch 248 tokens · noise scale ≈ 1,481 tokens")
    assert verdict(64, None) == "batch 64 samples · noise scale not yet known"
    # the batch is the mean over the measured steps: an epoch's short last batch makes it a fraction,
    # said as one, never rounded to a batch no step had
    assert verdict(63.58, None) == "batch 63.6 samples on average · noise scale not yet known"
    assert verdict(63.97, 70, "samples", 20, 300).startswith("batch 64 samples · noise scale ≈ 70")
    assert verdict(8191.7, None, "tokens").startswith("batch 8,191.7 tokens on average")


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 7, dtype=F64)
        self.b = nn.Linear(7, 3, dtype=F64)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


@pytest.mark.parametrize("strategy", ["replicate", "persistent"])
@pytest.mark.parametrize(
    ("lanes", "weights", "sizes_"),
    # (13, 1): the second micro-batch's one sample is lane 0's alone, a step the other lanes sit out
    [(2, None, (13, 9)), (3, [3, 1, 2], (13, 9)), (3, [3, 1, 2], (13,)), (2, None, (13, 1)), (3, [3, 1, 2], (13, 1))],
)
def test_each_strategy_catches_each_lanes_own_gradient_exactly(strategy, lanes, weights, sizes_):
    accum = len(sizes_)
    torch.manual_seed(0)
    model = Mlp()
    ref = Mlp()
    ref.load_state_dict(model.state_dict())
    backend = make_backend(parse_devices(",".join(f"cpu:{i}" for i in range(lanes))))
    strat = make_strategy(strategy, backend)
    probe = LaneGradProbe(lanes, torch.device("cpu"))
    strat.lane_grads = probe
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(n, 5, generator=g, dtype=F64), torch.randn(n, 3, generator=g, dtype=F64)) for n in sizes_]
    loss_fn = nn.functional.mse_loss
    try:
        for _ in range(2):  # the second step runs on replicas built at the first (persistent)
            probe.arm(accum=accum)
            for p in model.parameters():
                p.grad = None
            for x, y in batches:
                out = strat.forward_loss(model, x, y, loss_fn, chunk_sizes(len(x), lanes, weights), PhaseTimer())
                strat.backward(out, out.loss / accum)
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
                        (loss_fn(ref(xs), ys) * len(xs) / len(x) / accum).backward()
                grads = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])
                expect.append(grads.square().sum().item())
                total = grads if total is None else total + grads
            assert caught == pytest.approx(expect, rel=1e-12)
            mine = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            assert torch.allclose(mine, total, rtol=1e-12, atol=0)
    finally:
        strat.close()
        backend.close()


# -- a default run against brute force -------------------------------------------------------------
N, D, H = 2000, 6, 16


class MlpRegression(Task):
    """A float64 MLP whose every training sample's gradient is brute-forced (``torch.func``)."""

    name = "mlp-regression"

    def build_model(self):
        return nn.Sequential(nn.Linear(D, H, dtype=F64), nn.Tanh(), nn.Linear(H, 1, dtype=F64))

    def data(self):
        g = torch.Generator().manual_seed(3)
        x = torch.randn(N, D, generator=g, dtype=F64)
        y = torch.sin(x[:, :3].sum(1, keepdim=True)) + 1.5 * torch.randn(N, 1, generator=g, dtype=F64) + 1
        return ArrayData(x, y), None

    def loss(self, output, target):
        return nn.functional.mse_loss(output, target)


def brute_force(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """``|G|²`` and ``tr Σ`` over the training samples, from every sample's own gradient."""
    from torch.func import functional_call, grad, vmap

    params = {k: v.detach() for k, v in model.named_parameters()}

    def one(p, xi, yi):
        return nn.functional.mse_loss(functional_call(model, p, (xi[None],)), yi[None])

    per = vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)
    flat = torch.cat([g.reshape(len(x), -1) for g in per.values()], 1)
    mean = flat.mean(0)
    return mean.square().sum().item(), (flat - mean).square().sum(1).mean().item()


class Noise(TrainerCallback):
    def __init__(self) -> None:
        self.values: list[dict] = []
        self.health: list[int] = []

    def on_log(self, record: dict) -> None:
        if "noise" in record:
            self.values.append(record["noise"])

    def on_health(self, record: dict) -> None:
        self.health.append(record["step"])


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "weights"), [("replicate", [3, 1, 2]), ("persistent", [2, 1])])
def test_a_default_run_shows_the_noise_scale_within_30_percent_and_its_band_holds_the_truth(
    make_config, strategy, weights
):
    # The health section as shipped (noise every 4 steps, read every 10); 7 epochs of 32 batches of
    # 60 (each epoch's last one 20 samples): the weights stay put (lr 1e-12), so G and Σ do too.
    task = MlpRegression()
    cfg = make_config(
        devices__use=",".join(f"cpu:{i}" for i in range(len(weights))),
        devices__strategy=strategy,
        devices__weights=weights,
        train__epochs=7,
        train__log_every=10,
        data__batch_size=60,
        data__val_fraction=0.0,
        optim__name="sgd",
        optim__lr=1e-12,
    )
    noise = Noise()
    trainer = Trainer(cfg, callbacks=[noise], task=task)
    assert trainer.run().status == "finished"
    data = task.data()[0]
    g2, trace = brute_force(trainer.model, data.inputs, data.target)
    got = noise.values[-1]
    truth = trace / g2
    steps = [s for s in range(1, trainer.step + 1) if measured(s, 4) or s % 50 == 0]  # a sampled step: measured too
    assert got["steps"] == len(steps) and got["unit"] == "samples"
    assert 55 < got["batch"] < 60  # the steps' mean batch: the short last ones count as they are
    assert abs(got["b_simple"] / truth - 1) < 0.3, (got, truth)
    assert got["lo"] <= truth <= got["hi"], (got, truth)
    assert got["hi"] / got["lo"] < 3  # a band that says something
    assert noise.health == [s for s in range(1, trainer.step + 1) if s % 50 == 0]  # layers: every 50 still


def test_one_device_says_why_there_is_no_noise_scale():
    mon = HealthMonitor(HealthSection(), 1, torch.device("cpu"))
    assert mon.probe is None
    assert mon.noise_note == ONE_DEVICE
    assert "two or more devices" in ONE_DEVICE
    assert math.isfinite(HealthSection().every)


def test_a_replayed_step_is_neither_sampled_nor_measured_on_any_strategy():
    # Under ddp and fsdp the probe is fed by the gradients' collective (``always``) while it is armed, not
    # by the lanes' hook a replay replaces: a NaN's replay mutes the whole monitor, not only its sampling.
    mon = HealthMonitor(HealthSection(every=1, noise_every=1), 2, torch.device("cpu"), exchange=lambda v: None)
    model = nn.Linear(2, 1)

    def step(s: int) -> None:
        mon.begin_step(s, model, 1)
        model(torch.ones(3, 2)).sum().backward()
        mon.after_reduce(model, None)
        mon.before_update()
        mon.after_update()

    mon.muted = True
    step(1)
    assert not mon.probe.armed and mon._pending == []
    mon.muted = False
    step(2)
    assert [s for s, *_ in mon._pending] == [2]  # the run's own steps: sampled and measured as before


@pytest.mark.parametrize(("every", "noise_every", "lanes"), [(50, 4, 2), (7, 1, 2), (5, 300, 3), (10, 4, 1), (0, 4, 2)])
def test_the_steps_the_loop_skips_are_exactly_those_neither_sampled_nor_measured(every, noise_every, lanes):
    # The loop calls begin_step only on a step outside ``idle`` (no Python call on the others): the steps
    # it arms must be the very steps a call on every step arms, from any first step (a resumed run).
    cfg = HealthSection(enabled=every > 0, every=max(every, 1), noise_every=noise_every)
    for first in (1, 37):
        mon = HealthMonitor(cfg, lanes, torch.device("cpu"), exchange=lambda v: None)
        model = nn.Linear(2, 1)
        armed = []
        for s in range(first, 2000):
            if s not in mon.idle:
                mon.begin_step(s, model, 1)
            if mon.on:
                armed.append(s)
                mon.abandon()
        due = [s for s in range(first, 2000) if every and (s % every == 0 or (lanes > 1 and measured(s, noise_every)))]
        assert armed == due and (due or every == 0)


def test_the_batch_is_counted_in_tokens_where_the_task_counts_tokens():
    from multilane.engine.health.run_health import make_monitor
    from multilane.engine.tasks import loss_weight_fn
    from multilane.engine.tasks.charlm import CharLMTask

    class ClassWeighted(MlpRegression):  # a loss_weight with no loss_unit
        def loss_weight(self, output, target):
            return float(len(target))

    units = []
    for task in (CharLMTask(), ClassWeighted(), MlpRegression()):
        units.append(make_monitor(HealthSection(), task, loss_weight_fn(task) is not None, 2, torch.device("cpu")).unit)
    assert units == ["tokens", "loss weight", "samples"]


def test_watch_prints_the_noise_scale_and_its_band_as_the_view_does():
    from multilane.engine.cli.watch import WatchState

    state = WatchState()
    state.add({"kind": "train", "step": 50, "loss": 1.0, "noise": {"b_simple": 15.2, "batch": 64}})
    assert "noise scale ≈ 15 ·" in state.line() + " ·" and "15.2000" not in state.line()
    assert "noise scale ≈ 15 samples (95 % band" in verdict(64, 15.2, "samples", 12.1, 19.4)
    noise = {"b_simple": 1481.4, "lo": 1203.0, "hi": 1902.2, "batch": 248, "unit": "tokens"}
    state.add({"kind": "train", "step": 60, "loss": 1.0, "noise": noise})
    assert "noise scale ≈ 1,481 tokens (95 % band 1,203–1,902)" in state.line()
