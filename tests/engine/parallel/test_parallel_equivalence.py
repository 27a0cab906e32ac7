"""Data-parallel training on CPU lanes equals single-device full-batch training (float64, 1e-10)."""

import copy

import pytest
import torch
from helpers import max_rel_diff
from multilane.engine.parallel import ReplicateEachStep, chunk_sizes, make_backend
from multilane.engine.parallel.timing import PhaseTimer
from multilane.engine.telemetry.devices import parse_devices
from torch import nn
from torch.nn import functional as F


def lanes(n):
    return parse_devices(",".join(f"cpu:{i}" for i in range(n)))


def net():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 3)).double()


def data(batch=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 10, generator=g, dtype=torch.float64), torch.randn(
        batch, 3, generator=g, dtype=torch.float64
    )


OPTIMIZERS = {
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "sgd-nesterov": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
}


def reference(opt_name, steps, batches):
    model = net()
    opt = OPTIMIZERS[opt_name](model.parameters())
    for x, y in batches[:steps]:
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return model


def train_on_lanes(n, opt_name, steps, batches, weights=None):
    model = net()
    opt = OPTIMIZERS[opt_name](model.parameters())
    backend = make_backend(lanes(n))
    step = ReplicateEachStep(backend)
    timer = PhaseTimer()
    try:
        for x, y in batches[:steps]:
            opt.zero_grad()
            out = step.forward_loss(model, x, y, F.mse_loss, chunk_sizes(len(x), n, weights), timer)
            out.loss.backward()
            opt.step()
    finally:
        backend.close()
    return model


BATCHES = [data(37, seed=s) for s in range(6)]


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_lanes_equal_full_batch_training(n, opt_name):
    ref = reference(opt_name, 6, BATCHES)
    got = train_on_lanes(n, opt_name, 6, BATCHES)
    assert max_rel_diff(got, ref) < 1e-10


@pytest.mark.parametrize("weights", [[3, 1], [1, 2, 5], [0.1, 0.2, 0.3, 0.4]])
def test_uneven_splits_equal_full_batch_training(weights):
    ref = reference("adam", 6, BATCHES)
    got = train_on_lanes(len(weights), "adam", 6, BATCHES, weights)
    assert max_rel_diff(got, ref) < 1e-10


def test_batch_smaller_than_lane_count_trains_on_the_lanes_it_fills():
    small = [data(3, seed=s) for s in range(4)]
    ref = reference("sgd-momentum", 4, small)
    got = train_on_lanes(4, "sgd-momentum", 4, small)
    assert max_rel_diff(got, ref) < 1e-10


def test_each_lane_reports_its_own_shard_loss():
    model = net()
    x, y = data(37)
    backend = make_backend(lanes(3))
    sizes = chunk_sizes(37, 3, [1, 2, 2])
    out = ReplicateEachStep(backend).forward_loss(model, x, y, F.mse_loss, sizes, PhaseTimer())
    backend.close()
    start = 0
    for i, s in enumerate(sizes):
        direct = F.mse_loss(model(x[start : start + s]), y[start : start + s])
        assert out.lane_losses[i].item() == pytest.approx(direct.item(), rel=1e-12)
        start += s
    assert out.loss.item() == pytest.approx(F.mse_loss(model(x), y).item(), rel=1e-12)
    assert out.lanes == [0, 1, 2]


def test_a_lane_with_an_empty_chunk_sits_out():
    model = net()
    x, y = data(2)
    backend = make_backend(lanes(3))
    out = ReplicateEachStep(backend).forward_loss(model, x, y, F.mse_loss, chunk_sizes(2, 3), PhaseTimer())
    backend.close()
    assert out.lanes == [0, 1] and out.lane_losses.shape == (2,)


def test_gradients_of_all_replicas_reach_the_original_parameters():
    model = net()
    ref = copy.deepcopy(model)
    x, y = data(40)
    backend = make_backend(lanes(4))
    ReplicateEachStep(backend).forward_loss(model, x, y, F.mse_loss, chunk_sizes(40, 4), PhaseTimer()).loss.backward()
    backend.close()
    F.mse_loss(ref(x), y).backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)
