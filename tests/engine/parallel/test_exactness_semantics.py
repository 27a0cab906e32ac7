"""The exactness rules, one by one: true replicas, in-place parameter changes, loss weights, gather,
precision. (tests/test_exactness.py trains whole models; these pin each rule and its clear errors.)"""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass

import pytest
import torch
from multilane.engine.parallel import ReplicateEachStep, chunk_sizes, make_backend
from multilane.engine.parallel.lane_loss import LossWeightError
from multilane.engine.parallel.replicas.inplace import InplaceParameterError
from multilane.engine.parallel.replicas.replica import replicate_module
from multilane.engine.parallel.timing import PhaseTimer
from multilane.engine.parallel.tree import GatherError
from multilane.engine.telemetry.devices import parse_devices
from torch import nn
from torch.nn import functional as F


@pytest.fixture
def three_lanes():
    backend = make_backend(parse_devices("cpu:0,cpu:1,cpu:2"))
    yield ReplicateEachStep(backend)
    backend.close()


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).double()


# -- true replicas --------------------------------------------------------------------------------
def test_every_lane_gets_its_own_copy_of_each_parameter_and_sees_it_in_parameters(three_lanes):
    model = net()
    replicas = three_lanes.backend.replicate(model, [0, 1, 2], detach=False)
    originals = list(model.parameters())
    seen = set()
    for replica, params in zip(replicas, replicas.params, strict=True):
        mine = list(replica.parameters())
        assert [n for n, _ in replica.named_parameters()] == [n for n, _ in model.named_parameters()]
        assert all(a is b for a, b in zip(mine, params, strict=True))
        for p, q in zip(mine, originals, strict=True):
            assert p is not q and p.data_ptr() != q.data_ptr()  # lane 0 too: no lane is special
            assert torch.equal(p, q) and p.requires_grad
            seen.add(p.data_ptr())
    assert len(seen) == 3 * len(originals)


def test_once_a_model_is_known_not_to_write_its_parameters_lanes_get_views_not_copies(three_lanes):
    model = net()
    x, y = torch.randn(9, 4, dtype=torch.float64), torch.randn(9, 2, dtype=torch.float64)
    seen = []
    model.register_forward_pre_hook(lambda m, args: seen.append([p.data_ptr() for p in m.parameters()]))
    for _ in range(2):
        three_lanes.forward_loss(model, x, y, F.mse_loss, chunk_sizes(9, 3), PhaseTimer()).loss.backward()
    originals = [p.data_ptr() for p in model.parameters()]
    first, second = seen[:3], seen[3:]
    assert all(ptrs != originals for ptrs in first)  # step 1: private copies on every lane
    assert all(ptrs == originals for ptrs in second)  # then views of the original data: no copy


class WritesFromStepTwo(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 1).double()
        self.calls = [0]  # shared by the replicas (each has its own copy of the module's attributes)

    def forward(self, x):
        self.calls[0] += 1
        if self.calls[0] > 3:  # after the first (3-lane) forward
            with torch.no_grad():
                self.lin.weight.clamp_(-0.1, 0.1)
        return self.lin(x)


def test_a_model_that_starts_writing_its_parameters_later_is_refused(three_lanes):
    m = WritesFromStepTwo()
    x = torch.randn(6, 3, dtype=torch.float64)
    three_lanes.forward(m, x, chunk_sizes(6, 3))
    with pytest.raises(
        InplaceParameterError, match=r"parameter 'lin.weight' was changed in place during this forward but not"
    ):
        three_lanes.forward(m, x, chunk_sizes(6, 3))


def test_the_gpu_backend_replicates_with_the_same_function():
    # CudaBackend.replicate is replicate_module over its devices; here over CPU devices, the same code.
    model = net()
    replicas = replicate_module(model, [torch.device("cpu")] * 2, detach=False, buffer_owner=0)
    x = torch.randn(5, 4, dtype=torch.float64)
    (replicas[0](x).sum() + 2 * replicas[1](x).sum()).backward()
    ref = net()
    (3 * ref(x).sum()).backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-14, atol=1e-14)


def test_a_parameter_no_lane_uses_gets_no_gradient(three_lanes):
    class Unused(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(3, 1), nn.Linear(3, 1)

        def forward(self, x):
            return self.used(x)

    m = Unused()
    x, y = torch.randn(9, 3), torch.randn(9, 1)
    three_lanes.forward_loss(m, x, y, F.mse_loss, chunk_sizes(9, 3), PhaseTimer()).loss.backward()
    assert m.used.weight.grad is not None
    assert m.unused.weight.grad is None  # as on one device (torch's Broadcast would give zeros)


def test_an_lstm_replica_computes_with_its_own_weights(three_lanes):
    torch.manual_seed(0)
    lstm = nn.LSTM(3, 4, batch_first=True).double()
    x = torch.randn(6, 5, 3, dtype=torch.float64)
    out = three_lanes.forward(lstm, x, chunk_sizes(6, 3))
    torch.testing.assert_close(out[0], lstm(x)[0], rtol=1e-14, atol=1e-14)
    out[0].sum().backward()
    assert all(p.grad is not None for p in lstm.parameters())


# -- in-place parameter changes in forward --------------------------------------------------------
class Decay(nn.Module):
    """Shrinks its whole weight in place before using it: the same change on every lane."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2).double()

    def forward(self, x):
        with torch.no_grad():
            self.lin.weight.mul_(0.5)
        return self.lin(x)


def test_the_same_in_place_change_on_every_lane_equals_one_device(three_lanes):
    torch.manual_seed(0)
    m, ref = Decay(), Decay()
    ref.load_state_dict(m.state_dict())
    x = torch.randn(7, 3, dtype=torch.float64)
    out = three_lanes.forward(m, x, chunk_sizes(7, 3))
    torch.testing.assert_close(out, ref(x), rtol=1e-15, atol=1e-15)
    torch.testing.assert_close(m.lin.weight, ref.lin.weight, rtol=0, atol=0)  # halved once, not 3 times


class RowBump(nn.Module):
    """Adds 1 to the rows its batch looks up, then reads every row: each application changes it again."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.zeros(5, 2, dtype=torch.float64))

    def forward(self, idx):
        with torch.no_grad():
            self.table[idx] += 1.0
        return (self.table.sum() + self.table[idx].sum(1)).unsqueeze(-1).expand(len(idx), 1) * 1.0


def test_an_in_place_change_that_does_not_settle_is_refused_in_one_line(three_lanes):
    idx = torch.tensor([0, 1, 2, 3, 4, 0])
    with pytest.raises(
        InplaceParameterError, match=r"parameter 'table' in place again .* train this model on one device"
    ):
        three_lanes.forward(RowBump(), idx, chunk_sizes(6, 3))


class LaneDependent(nn.Module):
    """Writes its shard's size into every element: lanes disagree on the same element."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(2, dtype=torch.float64))

    def forward(self, x):
        with torch.no_grad():
            self.w.fill_(len(x))
        return x * self.w.sum()


def test_lanes_changing_one_element_to_different_values_are_refused(three_lanes):
    with pytest.raises(
        InplaceParameterError, match=r"parameter 'w' was changed in place to different values on lanes cpu:0 and cpu:1"
    ):
        three_lanes.forward(LaneDependent(), torch.ones(7, 1, dtype=torch.float64), chunk_sizes(7, 3, [3, 2, 2]))


# -- losses with their own normalizer -------------------------------------------------------------
def token_loss(out, y):
    return F.cross_entropy(out, y, ignore_index=-100)


def token_count(out, y):
    return (y != -100).sum()


def test_a_lane_whose_shard_holds_no_weight_sits_out_without_nan(three_lanes):
    m = net()
    x = torch.randn(9, 4, dtype=torch.float64)
    y = torch.randint(0, 2, (9,))
    y[3:6] = -100  # lane 1's whole shard is padding
    out = three_lanes.forward_loss(m, x, y, token_loss, chunk_sizes(9, 3), PhaseTimer(), weight_fn=token_count)
    assert out.lanes == [0, 2] and out.lane_losses.shape == (2,)
    assert out.weight.item() == 6
    out.loss.backward()
    ref = net()
    token_loss(ref(x), y).backward()
    assert out.loss.item() == pytest.approx(token_loss(ref(x), y).item(), rel=1e-14)
    for p, q in zip(m.parameters(), ref.parameters(), strict=True):
        assert torch.isfinite(p.grad).all()
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-13, atol=1e-15)


def test_a_batch_that_is_all_padding_gives_nan_as_on_one_device(three_lanes):
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.full((6,), -100)
    out = three_lanes.forward_loss(net(), x, y, token_loss, chunk_sizes(6, 3), PhaseTimer(), weight_fn=token_count)
    assert torch.isnan(out.loss) and torch.isnan(token_loss(net()(x), y))


@pytest.mark.parametrize(
    ("weight", "message"),
    [
        (lambda o, y: -1.0, "finite number >= 0, got -1.0"),
        (lambda o, y: torch.ones(2), r"one number, got shape \(2,\)"),
        (lambda o, y: "3", "a number or a 0-dim tensor, got str"),
    ],
)
def test_a_bad_loss_weight_is_named(three_lanes, weight, message):
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 2, (6,))
    with pytest.raises(ValueError, match=message):
        three_lanes.forward_loss(net(), x, y, token_loss, chunk_sizes(6, 3), PhaseTimer(), weight_fn=weight)
    assert issubclass(LossWeightError, ValueError)


# -- gather ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Out:
    logits: torch.Tensor
    aux: torch.Tensor
    label: str = "out"


Pair = namedtuple("Pair", "a b")


class Structured(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.lin = nn.Linear(4, 2).double()
        self.kind = kind

    def forward(self, x):
        y = self.lin(x)
        aux = y.pow(2).mean()
        if self.kind == "scalar":
            return y, aux
        if self.kind == "dataclass":
            return Out(y, aux)
        if self.kind == "nested":
            return {"pair": Pair(y, [aux, None]), "n": 3}
        if self.kind == "float":
            return y, float(aux.detach())
        return y, object()


def test_zero_dim_outputs_become_one_entry_per_lane(three_lanes):
    m = Structured("scalar")
    x = torch.randn(7, 4, dtype=torch.float64)
    y, aux = three_lanes.forward(m, x, chunk_sizes(7, 3))
    assert aux.shape == (3,)
    torch.testing.assert_close(aux[1], m.lin(x[3:5]).pow(2).mean())
    torch.testing.assert_close(y, m.lin(x))


def test_dataclass_and_nested_outputs_keep_every_lane(three_lanes):
    x = torch.randn(7, 4, dtype=torch.float64)
    out = three_lanes.forward(Structured("dataclass"), x, chunk_sizes(7, 3))
    assert isinstance(out, Out) and out.logits.shape == (7, 2) and out.aux.shape == (3,) and out.label == "out"
    nested = three_lanes.forward(Structured("nested"), x, chunk_sizes(7, 3))
    assert isinstance(nested["pair"], Pair) and nested["pair"].a.shape == (7, 2)
    assert nested["pair"].b[0].shape == (3,) and nested["pair"].b[1] is None and nested["n"] == 3


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("float", r"output\[1\]: a float that differs between lanes cannot be gathered; return it as a tensor"),
        ("object", r"output\[1\]: cannot gather a object across lanes"),
    ],
)
def test_an_output_that_cannot_be_gathered_is_named(three_lanes, kind, message):
    with pytest.raises(GatherError, match=message):
        three_lanes.forward(Structured(kind), torch.randn(7, 4, dtype=torch.float64), chunk_sizes(7, 3))


# -- precision ------------------------------------------------------------------------------------
@pytest.mark.parametrize("devices", ["cpu:0", "cpu:0,cpu:1"])
def test_the_loss_is_computed_inside_autocast_on_any_lane_count(devices):
    torch.manual_seed(0)
    m = nn.Linear(16, 4)
    x, y = torch.randn(10, 16), torch.randint(0, 4, (10,))
    backend = make_backend(parse_devices(devices))
    n = backend.n
    step = ReplicateEachStep(backend, "bf16")
    out = step.forward_loss(m, x, y, F.cross_entropy, chunk_sizes(10, n), PhaseTimer())
    backend.close()
    expected = []
    for xs, ys in zip(x.split(chunk_sizes(10, n)), y.split(chunk_sizes(10, n)), strict=True):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected.append(F.cross_entropy(m(xs), ys).float() * len(xs) / 10)
    assert out.loss.dtype == torch.float32
    assert out.loss.item() == pytest.approx(sum(expected).item(), rel=1e-6)
