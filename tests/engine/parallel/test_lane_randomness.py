"""Each lane its own random stream: dropout under activation checkpointing gets the gradient of the
forward actually taken, on any lane count, and a multi-lane run with dropout reproduces from its seed."""

import pytest
import torch
from multilane.engine.parallel import ReplicateEachStep, chunk_sizes, make_backend
from multilane.engine.parallel.replicas.lane_rng import lane_seed
from multilane.engine.parallel.timing import PhaseTimer
from multilane.engine.telemetry.devices import parse_devices
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

SEED = 5


def lanes(n):
    return parse_devices(",".join(f"cpu:{i}" for i in range(n)))


class DropoutNet(nn.Module):
    """Dropout inside an activation-checkpointed block (recomputed in backward), and one outside it."""

    def __init__(self, use_checkpoint=True, reentrant=False):
        super().__init__()
        self.inp = nn.Linear(6, 16)  # outside the block: reentrant checkpointing needs an input with grad
        self.block = nn.Sequential(nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 16), nn.Tanh())
        self.drop = nn.Dropout(0.2)
        self.out = nn.Linear(16, 2)
        self.use_checkpoint, self.reentrant = use_checkpoint, reentrant

    def forward(self, x):
        x = self.inp(x)
        h = checkpoint(self.block, x, use_reentrant=self.reentrant) if self.use_checkpoint else self.block(x)
        return self.out(self.drop(h))


def make_model(**kw):
    torch.manual_seed(SEED)  # the run's seed: weights first, then lane 0's stream, as in a plain script
    return DropoutNet(**kw).double()


def batches(steps=4, batch=23):
    g = torch.Generator().manual_seed(2)
    return [
        (
            torch.randn(batch, 6, generator=g, dtype=torch.float64),
            torch.randn(batch, 2, generator=g, dtype=torch.float64),
        )
        for _ in range(steps)
    ]


def lane_run(n, weights=None, data=None, **kw):
    """Train on ``n`` CPU lanes; each step's loss and gradient, and the final weights."""
    model = make_model(**kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    backend = make_backend(lanes(n))
    step = ReplicateEachStep(backend, seed=SEED)
    losses, grads = [], []
    try:
        for x, y in data or batches():
            opt.zero_grad()
            out = step.forward_loss(model, x, y, F.mse_loss, chunk_sizes(len(x), n, weights), PhaseTimer())
            out.loss.backward()
            losses.append(out.loss.detach().clone())
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
            opt.step()
    finally:
        backend.close()
    return torch.stack(losses), torch.stack(grads), torch.cat([p.detach().flatten() for p in model.parameters()])


def hand_loop(n, weights=None, data=None):
    """The reference, by hand on one device: each lane's chunk through the model with that lane's own
    generator state (lane 0: the default generator; lane i: seeded from the seed and i), the loss
    weighted by chunk size, one backward, one step. No checkpointing."""
    model = make_model(use_checkpoint=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    states = {i: torch.Generator().manual_seed(lane_seed(SEED, i)).get_state() for i in range(1, n)}
    losses, grads = [], []
    for x, y in data or batches():
        sizes = chunk_sizes(len(x), n, weights)
        opt.zero_grad()
        total, start = 0.0, 0
        for i, size in enumerate(sizes):
            if size == 0:
                continue
            xi, yi = x[start : start + size], y[start : start + size]
            start += size
            if i == 0:
                out = model(xi)
            else:
                with torch.random.fork_rng(devices=[]):
                    torch.set_rng_state(states[i])
                    out = model(xi)
                    states[i] = torch.get_rng_state()
            total = total + F.mse_loss(out, yi) * (size / len(x))
        total.backward()
        losses.append(total.detach().clone())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        opt.step()
    return torch.stack(losses), torch.stack(grads), torch.cat([p.detach().flatten() for p in model.parameters()])


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


SPLITS = [(1, None), (2, None), (3, None), (2, [1, 3]), (3, [3, 1, 2]), (3, [0, 2, 1])]


@pytest.mark.parametrize(("n", "weights"), SPLITS)
@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_dropout_gets_the_gradient_of_the_forward_taken(n, weights, reentrant):
    got = lane_run(n, weights, reentrant=reentrant)
    plain = lane_run(n, weights, use_checkpoint=False)
    ref = hand_loop(n, weights)
    for g, p, r in zip(got, plain, ref, strict=True):
        assert rel(g, p) < 1e-12  # checkpointing changes nothing
        assert rel(g, r) < 1e-10  # each lane drew its own stream's masks


def test_one_lane_with_dropout_is_a_plain_script():
    data = batches()
    model = make_model(use_checkpoint=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in data:
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    _, _, weights = lane_run(1, data=data, use_checkpoint=False)
    assert torch.equal(weights, torch.cat([p.detach().flatten() for p in model.parameters()]))


@pytest.mark.parametrize("n", [2, 3])
def test_a_multi_lane_run_with_dropout_reproduces_from_its_seed(n):
    first, second = lane_run(n, [1, 1, 2][:n]), lane_run(n, [1, 1, 2][:n])
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def test_lanes_draw_different_masks():
    # Three lanes, the same input on each: lanes whose streams were alike would drop the same units.
    torch.manual_seed(SEED)
    backend = make_backend(lanes(3))
    try:
        out = ReplicateEachStep(backend, seed=SEED).forward(
            nn.Dropout(0.5), torch.ones(6, 32, dtype=torch.float64), chunk_sizes(6, 3)
        )
    finally:
        backend.close()
    rows = [tuple(r.tolist()) for r in out]
    assert len(set(rows)) == 6


def test_the_lane_streams_survive_a_save_and_load():
    data = batches(6)
    straight = lane_run(3, data=data)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def steps(step, part):
        for x, y in part:
            opt.zero_grad()
            step.forward_loss(model, x, y, F.mse_loss, chunk_sizes(len(x), 3), PhaseTimer()).loss.backward()
            opt.step()

    backend = make_backend(lanes(3))
    try:
        first = ReplicateEachStep(backend, seed=SEED)
        steps(first, data[:3])
        saved = first.random.state_dict()
        torch.manual_seed(123)  # whatever happens in between
        second = ReplicateEachStep(backend, seed=SEED)
        second.random.load_state_dict(saved)
        steps(second, data[3:])
    finally:
        backend.close()
    assert torch.equal(torch.cat([p.detach().flatten() for p in model.parameters()]), straight[2])


def test_a_model_without_randomness_runs_its_lanes_unlocked():
    backend = make_backend(lanes(2))
    try:
        step = ReplicateEachStep(backend)
        model = nn.Linear(3, 1)
        for _ in range(2):
            step.forward_loss(model, torch.randn(4, 3), torch.randn(4, 1), F.mse_loss, [2, 2], PhaseTimer())
        assert not step.random.locked("train") and not step.random.locked("loss")
    finally:
        backend.close()


class LateDropout(nn.Module):
    """BatchNorm, and dropout whose rate is scheduled up from 0 (so the first steps draw nothing)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(SEED)
        self.inp, self.bn = nn.Linear(6, 8), nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.0)
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        return self.out(self.drop(torch.tanh(self.bn(self.inp(x)))))


def late_dropout_run(locked_from_start):
    model = LateDropout().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    backend = make_backend(lanes(3))
    try:
        step = ReplicateEachStep(backend, seed=SEED)
        if locked_from_start:
            step.random.record("train", True)
        for i, (x, y) in enumerate(batches(5)):
            model.drop.p = 0.0 if i < 2 else 0.4
            if i == 2:
                assert step.random.locked("train") == locked_from_start
            opt.zero_grad()
            step.forward_loss(model, x, y, F.mse_loss, chunk_sizes(len(x), 3, [2, 1, 1]), PhaseTimer()).loss.backward()
            opt.step()
        assert step.random.locked("train")
    finally:
        backend.close()
    return model.state_dict()


def test_a_model_that_starts_drawing_later_gets_the_run_locked_from_the_start():
    # The unlocked call whose lanes drew is taken back (generators and buffers) and run again locked.
    got, ref = late_dropout_run(False), late_dropout_run(True)
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in got)


def test_a_model_with_dropout_keeps_its_lanes_locked():
    backend = make_backend(lanes(2))
    try:
        step = ReplicateEachStep(backend)
        model = make_model()
        for x, y in batches(2):
            step.forward_loss(model, x, y, F.mse_loss, chunk_sizes(len(x), 2), PhaseTimer())
        assert step.random.locked("train")
        with torch.no_grad():
            model.eval()
            step.forward(model, batches(1)[0][0], [12, 11])
            step.forward(model, batches(1)[0][0], [12, 11])
        assert not step.random.locked("eval")  # dropout draws nothing in eval mode
    finally:
        backend.close()


class TiedMaxNormDropout(nn.Module):
    """Embedding(max_norm) tied to the output layer, so the step replays the forward, and dropout."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(SEED)
        self.emb = nn.Embedding(13, 6, max_norm=1.0)
        self.drop = nn.Dropout(0.3)
        self.out = nn.Linear(6, 13, bias=False)
        self.out.weight = self.emb.weight
        with torch.no_grad():
            self.emb.weight.mul_(3.0)

    def forward(self, tokens):
        return self.out(self.drop(torch.tanh(self.emb(tokens).mean(dim=1))))


@pytest.mark.parametrize(("n", "weights"), [(2, None), (3, [1, 3, 2])])
def test_a_replayed_forward_draws_the_same_masks_again(n, weights):
    g = torch.Generator().manual_seed(9)
    data = [torch.randint(0, 13, (12, 3), generator=g) for _ in range(3)]
    model = TiedMaxNormDropout().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    backend = make_backend(lanes(n))
    try:
        step = ReplicateEachStep(backend, seed=SEED)
        for tokens in data:
            opt.zero_grad()
            sizes = chunk_sizes(len(tokens), n, weights)
            step.forward_loss(model, tokens, tokens[:, 0], F.cross_entropy, sizes, PhaseTimer()).loss.backward()
            opt.step()
    finally:
        backend.close()

    # By hand: renormalise the rows the whole batch looks up (what one device's forward does first),
    # then each lane's chunk with its own stream, drawn once.
    ref = TiedMaxNormDropout().double()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    states = {i: torch.Generator().manual_seed(lane_seed(SEED, i)).get_state() for i in range(1, n)}
    for tokens in data:
        sizes = chunk_sizes(len(tokens), n, weights)
        opt.zero_grad()
        with torch.no_grad():
            F.embedding(tokens, ref.emb.weight, max_norm=1.0)
        total = 0.0

        def forward(chunk):  # the model's forward with the rows already renormalised
            return ref.out(ref.drop(torch.tanh(F.embedding(chunk, ref.emb.weight).mean(dim=1))))

        for i, chunk in enumerate(torch.split(tokens, sizes)):
            if i == 0:
                out = forward(chunk)
            else:
                with torch.random.fork_rng(devices=[]):
                    torch.set_rng_state(states[i])
                    out = forward(chunk)
                    states[i] = torch.get_rng_state()
            total = total + F.cross_entropy(out, chunk[:, 0]) * (len(chunk) / len(tokens))
        total.backward()
        opt.step()
    assert rel(model.emb.weight.detach(), ref.emb.weight.detach()) < 1e-10


if __name__ == "__main__":
    # The measured maxima quoted in docs/design.md: python tests/test_lane_randomness.py
    print(f"{'model kind':58} {'loss':>8} {'grads':>8} {'params':>8}")
    for reentrant in (False, True):
        vs_hand, vs_plain = [0.0] * 3, [0.0] * 3
        for n, weights in SPLITS:
            got = lane_run(n, weights, reentrant=reentrant)
            ref, plain = hand_loop(n, weights), lane_run(n, weights, use_checkpoint=False)
            vs_hand = [max(m, rel(g, r)) for m, g, r in zip(vs_hand, got, ref, strict=True)]
            vs_plain = [max(m, rel(g, r)) for m, g, r in zip(vs_plain, got, plain, strict=True)]
        name = f"dropout in checkpoint (reentrant={reentrant})"
        print(f"{name + ' vs hand loop':58} " + " ".join(f"{x:8.1e}" for x in vs_hand))
        print(f"{name + ' vs no checkpoint':58} " + " ".join(f"{x:8.1e}" for x in vs_plain))
