"""A buffer that requires grad (a tensor the loss differentiates but the optimizer does not train)
keeps ``requires_grad`` and gets the one-device ``.grad`` on every lane count, under both strategies."""

import pytest
import torch
from multilane.engine.parallel import PersistentReplicas, ReplicateEachStep, chunk_sizes, make_backend
from multilane.engine.parallel.timing import PhaseTimer
from multilane.engine.telemetry.devices import parse_devices
from torch import nn
from torch.nn import functional as F


class ScaledByBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.body = nn.Linear(6, 2).double()
        self.register_buffer("scale", torch.tensor([1.5, -0.5], dtype=torch.float64).requires_grad_())

    def forward(self, x):
        return self.body(x) * self.scale


def data(steps=3, batch=11):
    g = torch.Generator().manual_seed(9)
    return [
        (torch.randn(batch, 6, generator=g, dtype=torch.float64), torch.randn(batch, 2, generator=g))
        for _ in range(steps)
    ]


def one_device():
    model = ScaledByBuffer()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for x, y in data():
        opt.zero_grad()
        model.scale.grad = None
        F.mse_loss(model(x), y.double()).backward()
        grads.append(model.scale.grad.clone())
        opt.step()
    return grads, model


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("strategy", [ReplicateEachStep, PersistentReplicas], ids=["replicate", "persistent"])
def test_a_buffer_that_requires_grad_keeps_its_flag_and_its_one_device_grad_on_lanes(n, strategy):
    ref_grads, ref = one_device()
    model = ScaledByBuffer()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    backend = make_backend(parse_devices(",".join(f"cpu:{i}" for i in range(n))))
    s = strategy(backend)
    timer = PhaseTimer()
    try:
        for step, (x, y) in enumerate(data()):
            out = s.forward_loss(model, x, y.double(), F.mse_loss, chunk_sizes(len(x), n, [3, 1, 2][:n]), timer)
            opt.zero_grad(set_to_none=True)
            model.scale.grad = None
            s.backward(out, out.loss)
            s.reduce_gradients(timer)
            opt.step()
            s.sync_replicas(model, timer)
            timer.end_step()
            assert model.scale.requires_grad, f"step {step + 1}: the buffer lost requires_grad"
            assert model.scale.grad is not None, f"step {step + 1}: the buffer has no .grad"
            torch.testing.assert_close(model.scale.grad, ref_grads[step], rtol=1e-10, atol=0)
    finally:
        s.close()
        backend.close()
    torch.testing.assert_close(model.body.weight, ref.body.weight, rtol=1e-10, atol=0)
