"""The intent of PyTorch's test/distributed/test_data_parallel.py, checked on CPU lanes.

Inputs as a tensor, a tuple and a dict; keyword arguments; models returning tuples, dicts and
namedtuples; non-tensor arguments shared by every replica; replicas sharing the parameters;
BatchNorm in eval mode (running statistics: tests/test_lane_batchnorm.py); a failing replica named with its device.
"""

from collections import namedtuple

import pytest
import torch
from multilane.engine.parallel import ReplicateEachStep, chunk_sizes, make_backend
from multilane.engine.parallel.timing import PhaseTimer
from multilane.engine.telemetry.devices import parse_devices
from torch import nn
from torch.nn import functional as F


@pytest.fixture
def two_lanes():
    backend = make_backend(parse_devices("cpu:0,cpu:1"))
    yield ReplicateEachStep(backend)
    backend.close()


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 2)
        self.b = nn.Linear(3, 2)

    def forward(self, x, z, scale=1.0):
        return (self.a(x) + self.b(z)) * scale


def test_tuple_inputs_are_positional_arguments(two_lanes):
    torch.manual_seed(0)
    m = TwoInputs()
    x, z = torch.randn(9, 4), torch.randn(9, 3)
    out = two_lanes.forward(m, (x, z), chunk_sizes(9, 2))
    torch.testing.assert_close(out, m(x, z))


def test_dict_inputs_are_keyword_arguments_and_scalars_are_shared(two_lanes):
    torch.manual_seed(0)
    m = TwoInputs()
    x, z = torch.randn(9, 4), torch.randn(9, 3)
    out = two_lanes.forward(m, {"x": x, "z": z, "scale": 2.5}, chunk_sizes(9, 2))
    torch.testing.assert_close(out, m(x, z, scale=2.5))


Pair = namedtuple("Pair", "logits extra")


class ReturnsStructures(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.kind = kind

    def forward(self, x):
        y = self.lin(x)
        if self.kind == "tuple":
            return y, y * 2
        if self.kind == "dict":
            return {"logits": y, "double": y * 2}
        return Pair(y, y * 2)


@pytest.mark.parametrize("kind", ["tuple", "dict", "namedtuple"])
def test_structured_outputs_are_gathered_in_shape(two_lanes, kind):
    torch.manual_seed(0)
    m = ReturnsStructures(kind)
    x = torch.randn(7, 4)
    out = two_lanes.forward(m, x, chunk_sizes(7, 2))
    ref = m(x)
    assert type(out) is type(ref)
    if kind == "dict":
        torch.testing.assert_close(out["double"], ref["double"])
    else:
        torch.testing.assert_close(out[1], ref[1])


def test_model_returning_a_tuple_trains_with_a_loss_on_its_first_element(two_lanes):
    torch.manual_seed(0)
    m = ReturnsStructures("tuple").double()
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)

    def loss(out, target):
        return F.mse_loss(out[0], target)

    out = two_lanes.forward_loss(m, x, y, loss, chunk_sizes(8, 2), PhaseTimer())
    assert out.loss.item() == pytest.approx(F.mse_loss(m(x)[0], y).item(), rel=1e-12)


def test_eval_mode_batchnorm_uses_running_stats_on_every_lane(two_lanes):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).eval()
    x = torch.randn(10, 4)
    with torch.no_grad():
        torch.testing.assert_close(two_lanes.forward(m, x, chunk_sizes(10, 2)), m(x))


class FailsOnSecondShard(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 1)

    def forward(self, x):
        if x[0, 0].item() > 100:
            raise ValueError("bad shard")
        return self.lin(x)


def test_an_exception_in_one_replica_names_the_replica_and_the_device(two_lanes):
    x = torch.zeros(6, 2)
    x[3:, 0] = 1000  # the second lane's shard
    with pytest.raises(ValueError, match=r"Caught ValueError in replica 1 on device cpu:1") as info:
        two_lanes.forward(FailsOnSecondShard(), x, chunk_sizes(6, 2))
    assert "bad shard" in str(info.value)


def test_each_lane_runs_in_its_own_thread():
    backend = make_backend(parse_devices("cpu:0,cpu:1,cpu:2"))
    import threading

    seen = []
    fns = [lambda: seen.append(threading.current_thread().name)] * 3
    backend.parallel_apply(fns, [(), (), ()], None, [0, 1, 2])
    backend.parallel_apply(fns, [(), (), ()], None, [0, 1, 2])
    backend.close()
    assert len(set(seen)) == 3  # three threads, the same three both times
    assert all("multilane-cpu:" in name for name in seen)


def test_replicas_run_with_the_callers_grad_mode(two_lanes):
    m = nn.Linear(3, 1)
    with torch.no_grad():
        out = two_lanes.forward(m, torch.randn(4, 3), chunk_sizes(4, 2))
    assert not out.requires_grad
    assert two_lanes.forward(m, torch.randn(4, 3), chunk_sizes(4, 2)).requires_grad


def test_a_loss_that_is_not_a_number_is_refused(two_lanes):
    m = nn.Linear(3, 2)
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    with pytest.raises(ValueError, match="loss must be one number"):
        two_lanes.forward_loss(m, x, y, lambda o, t: (o - t) ** 2, chunk_sizes(4, 2), PhaseTimer())


def test_bf16_autocast_is_entered_inside_each_replica():
    backend = make_backend(parse_devices("cpu:0,cpu:1"))
    step = ReplicateEachStep(backend, precision="bf16")
    m = nn.Linear(8, 4)
    out = step.forward(m, torch.randn(6, 8), chunk_sizes(6, 2))
    backend.close()
    assert out.dtype == torch.bfloat16
