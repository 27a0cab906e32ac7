"""BatchNorm on lanes: buffers keep updating whatever the split, and synchronized BatchNorm equals
full-batch training exactly (float64: losses, gradients, parameters and running statistics)."""

import pytest
import torch
from multilane.engine.parallel import ReplicateEachStep, chunk_sizes, make_backend
from multilane.engine.parallel.replicas.lane_context import LaneSyncError
from multilane.engine.parallel.replicas.lane_rng import lane_seed
from multilane.engine.parallel.replicas.sync_batchnorm import LaneBatchNorm, SyncBatchNormError, convert_sync_batchnorm
from multilane.engine.parallel.timing import PhaseTimer
from multilane.engine.telemetry.devices import parse_devices
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint


def lanes(n):
    return parse_devices(",".join(f"cpu:{i}" for i in range(n)))


def mlp_bn():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2)).double()


class ConvBN(nn.Module):
    """A small CNN with BatchNorm2d (momentum None: cumulative averages) and a BatchNorm1d head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(4)
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4, momentum=None)
        self.head = nn.Linear(4 * 5 * 5, 2)
        self.bn_head = nn.BatchNorm1d(2, affine=False)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x)))
        return self.bn_head(self.head(h.flatten(1)))


MODELS = {
    "mlp+bn1d": (mlp_bn, lambda g, b: torch.randn(b, 6, generator=g, dtype=torch.float64) * 2 + 1),
    "cnn+bn2d": (lambda: ConvBN().double(), lambda g, b: torch.randn(b, 2, 5, 5, generator=g, dtype=torch.float64)),
}


def batches(kind, steps, batch):
    g = torch.Generator().manual_seed(11)
    make = MODELS[kind][1]
    return [(make(g, batch), torch.randn(batch, 2, generator=g, dtype=torch.float64)) for _ in range(steps)]


def plain_loop(kind, data):
    """The reference: full-batch training on one device, by hand."""
    model = MODELS[kind][0]()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, grads = [], []
    for x, y in data:
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        losses.append(loss.item())
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return losses, grads, model.state_dict()


def lane_loop(kind, data, n, weights=None, sync=True):
    model = MODELS[kind][0]()
    if sync:
        convert_sync_batchnorm(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    backend = make_backend(lanes(n))
    step = ReplicateEachStep(backend)
    losses, grads = [], []
    try:
        for x, y in data:
            opt.zero_grad()
            out = step.forward_loss(model, x, y, F.mse_loss, chunk_sizes(len(x), n, weights), PhaseTimer())
            out.loss.backward()
            losses.append(out.loss.item())
            grads.append([p.grad.clone() for p in model.parameters()])
            opt.step()
    finally:
        backend.close()
    return losses, grads, model.state_dict()


def max_rel(a, b):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def maxima(got, ref):
    """Largest relative differences: (losses, gradients, parameters, buffers)."""
    (la, ga, sa), (lb, gb, sb) = got, ref
    # Gradients relative to the step's largest gradient: a bias just before BatchNorm has a true
    # gradient of 0, which both sides compute as rounding noise.
    grads = max(
        max_rel(torch.cat([p.flatten() for p in a]), torch.cat([q.flatten() for q in b]))
        for a, b in zip(ga, gb, strict=True)
    )
    assert sa.keys() == sb.keys()
    buffers = {k for k in sa if "running" in k or "num_batches" in k}
    params = max(max_rel(sa[k], sb[k]) for k in sa if k not in buffers)
    bufs = max((max_rel(sa[k], sb[k]) for k in buffers), default=0.0)
    return max_rel(la, lb), grads, params, bufs


def compare(got, ref):
    return max(maxima(got, ref))


SPLITS = [(1, None), (2, None), (3, None), (2, [3, 1]), (3, [1, 2, 4]), (2, [0, 1]), (3, [2, 0, 1])]


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize(("n", "weights"), SPLITS)
def test_sync_batchnorm_equals_full_batch_training(kind, n, weights):
    data = batches(kind, 4, 21)
    ref = plain_loop(kind, data)
    got = lane_loop(kind, data, n, weights, sync=True)
    assert compare(got, ref) < 1e-10
    assert got[2]["1.num_batches_tracked" if kind == "mlp+bn1d" else "bn.num_batches_tracked"].item() == 4


@pytest.mark.parametrize("n", [2, 3])
def test_without_sync_each_lane_normalizes_its_own_shard(n):
    # The DataParallel semantics, kept when sync_batchnorm is off: not full-batch training.
    data = batches("mlp+bn1d", 2, 21)
    assert compare(lane_loop("mlp+bn1d", data, n, sync=False), plain_loop("mlp+bn1d", data)) > 1e-6


@pytest.mark.parametrize("weights", [[0, 1], [0, 0, 1]])
def test_running_stats_update_when_lane_0_gets_no_samples(weights):
    # All samples on the last lane: that is full-batch training, buffers included (DataParallel would
    # keep replica 0's untouched buffers).
    data = batches("mlp+bn1d", 3, 16)
    got = lane_loop("mlp+bn1d", data, len(weights), weights, sync=False)
    assert compare(got, plain_loop("mlp+bn1d", data)) < 1e-10
    assert got[2]["1.num_batches_tracked"].item() == 3


@pytest.mark.parametrize(("n", "weights"), [(2, None), (2, [3, 1]), (3, [1, 2, 4])])
def test_running_mean_without_sync_is_the_whole_batch_s(n, weights):
    """Buffers are the sample-weighted mean of the replicas': the running mean is the batch's exactly,
    the running variance the mean of the lanes' own variances."""
    model = mlp_bn()
    x, _ = batches("mlp+bn1d", 1, 23)[0]
    sizes = chunk_sizes(23, n, weights)
    backend = make_backend(lanes(n))
    try:
        ReplicateEachStep(backend).forward(model, x, sizes)
    finally:
        backend.close()
    with torch.no_grad():
        h = mlp_bn()[0](x)
    m = 0.1
    torch.testing.assert_close(model[1].running_mean, m * h.mean(0), rtol=1e-12, atol=1e-14)
    shard_vars = [s.var(0) * len(s) for s in torch.split(h, sizes)]
    expected_var = (1 - m) + m * sum(shard_vars) / 23
    torch.testing.assert_close(model[1].running_var, expected_var, rtol=1e-12, atol=1e-14)


def test_buffers_the_forward_does_not_change_keep_their_exact_value():
    class WithConstant(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 1).double()
            self.register_buffer("scale", torch.tensor([0.1, 1 / 3, 2 / 7], dtype=torch.float64))

        def forward(self, x):
            return self.lin(x * self.scale)

    model = WithConstant()
    before = model.scale.clone()
    backend = make_backend(lanes(3))
    try:
        step = ReplicateEachStep(backend)
        for _ in range(5):
            step.forward(model, torch.randn(10, 3, dtype=torch.float64), chunk_sizes(10, 3, [1, 2, 4]))
    finally:
        backend.close()
    assert torch.equal(model.scale, before)


def test_sync_batchnorm_is_an_ordinary_batchnorm_outside_lanes():
    torch.manual_seed(0)
    plain = nn.BatchNorm2d(3).double()
    synced = convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(3).double()))[0]
    assert isinstance(synced, LaneBatchNorm)
    x = torch.randn(4, 3, 2, 2, dtype=torch.float64)
    torch.testing.assert_close(synced(x), plain(x))
    torch.testing.assert_close(synced.running_var, plain.running_var)
    synced.eval(), plain.eval()
    torch.testing.assert_close(synced(x), plain(x))


def test_sync_batchnorm_in_eval_mode_uses_running_stats_on_every_lane():
    model = convert_sync_batchnorm(mlp_bn())
    model.train()
    ref = mlp_bn()
    x = torch.randn(12, 6, dtype=torch.float64)
    model(x), ref(x)  # some running statistics
    model.eval(), ref.eval()
    backend = make_backend(lanes(3))
    try:
        with torch.no_grad():
            out = ReplicateEachStep(backend).forward(model, x, chunk_sizes(12, 3, [1, 1, 2]))
    finally:
        backend.close()
    torch.testing.assert_close(out, ref(x), rtol=1e-12, atol=1e-14)


class BNInsideCheckpoint(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Tanh())
        self.out = nn.Linear(4, 1)

    def forward(self, x):
        return self.out(checkpoint(self.block, x, use_reentrant=False))


def test_sync_batchnorm_inside_activation_checkpointing_is_refused_not_wrong():
    model = convert_sync_batchnorm(BNInsideCheckpoint().double())
    backend = make_backend(lanes(2))
    try:
        out = ReplicateEachStep(backend).forward_loss(
            model,
            torch.randn(8, 4, dtype=torch.float64),
            torch.randn(8, 1, dtype=torch.float64),
            F.mse_loss,
            chunk_sizes(8, 2),
            PhaseTimer(),
        )
        with pytest.raises(SyncBatchNormError, match=r"torch\.utils\.checkpoint"):
            out.loss.backward()
    finally:
        backend.close()


class FailsOnSecondLane(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.bn = nn.BatchNorm1d(3)

    def forward(self, x):
        if x[0, 0].item() > 100:
            raise ValueError("bad shard")
        return self.bn(self.lin(x))


def test_a_failing_lane_releases_the_lanes_waiting_for_its_statistics():
    model = convert_sync_batchnorm(FailsOnSecondLane())
    x = torch.zeros(6, 3)
    x[3:, 0] = 1000
    backend = make_backend(lanes(2))
    try:
        with pytest.raises((ValueError, LaneSyncError)) as info:
            ReplicateEachStep(backend).forward(model, x, chunk_sizes(6, 2))
    finally:
        backend.close()
    assert "bad shard" in str(info.value)


class BranchesOnData(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn1, self.bn2 = nn.BatchNorm1d(2), nn.BatchNorm1d(2)

    def forward(self, x):
        x = self.bn1(x)
        return self.bn2(x) if x.shape[0] > 3 else x


def test_lanes_taking_different_paths_fail_with_a_clear_line_instead_of_hanging():
    model = convert_sync_batchnorm(BranchesOnData())
    backend = make_backend(lanes(2))
    try:
        with pytest.raises(LaneSyncError, match="different paths"):
            ReplicateEachStep(backend).forward(model, torch.randn(7, 2), chunk_sizes(7, 2))
    finally:
        backend.close()


class DropoutThenBN(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(7)  # the run's seed: weights first, then lane 0's stream
        self.inp, self.drop, self.bn, self.out = nn.Linear(6, 8), nn.Dropout(0.3), nn.BatchNorm1d(8), nn.Linear(8, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.bn(self.drop(self.inp(x)))))


@pytest.mark.parametrize(("n", "weights"), [(2, None), (3, [1, 2, 4])])
def test_sync_batchnorm_with_dropout_equals_a_hand_loop_with_each_lane_s_masks(n, weights):
    """Lanes that run one at a time for their random streams still meet at every BatchNorm."""
    data = batches("mlp+bn1d", 3, 21)
    model = convert_sync_batchnorm(DropoutThenBN().double())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    backend = make_backend(lanes(n))
    try:
        step = ReplicateEachStep(backend, seed=7)
        for x, y in data:
            sizes = chunk_sizes(len(x), n, weights)
            opt.zero_grad()
            step.forward_loss(model, x, y, F.mse_loss, sizes, PhaseTimer()).loss.backward()
            opt.step()
        assert step.random.locked("train")
    finally:
        backend.close()

    ref = DropoutThenBN().double()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    states = {i: torch.Generator().manual_seed(lane_seed(7, i)).get_state() for i in range(1, n)}
    for x, y in data:
        sizes = chunk_sizes(len(x), n, weights)
        opt.zero_grad()
        hs = []
        for i, xi in enumerate(torch.split(x, sizes)):
            if i == 0:
                hs.append(ref.drop(ref.inp(xi)))
            else:
                with torch.random.fork_rng(devices=[]):
                    torch.set_rng_state(states[i])
                    hs.append(ref.drop(ref.inp(xi)))
                    states[i] = torch.get_rng_state()
        out = ref.out(torch.tanh(ref.bn(torch.cat(hs))))  # BatchNorm over the whole batch
        F.mse_loss(out, y).backward()
        opt.step()
    got, want = model.state_dict(), ref.state_dict()
    assert max(max_rel(got[k], want[k]) for k in want) < 1e-10


class TiedMaxNormBN(nn.Module):
    """Embedding(max_norm) tied to the output layer (the step runs the forward twice) and a BatchNorm."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(8)
        self.emb, self.bn = nn.Embedding(13, 6, max_norm=1.0), nn.BatchNorm1d(6)
        self.out = nn.Linear(6, 13, bias=False)
        self.out.weight = self.emb.weight
        with torch.no_grad():
            self.emb.weight.mul_(3.0)

    def forward(self, tokens):
        return self.out(torch.tanh(self.bn(self.emb(tokens).mean(dim=1))))


@pytest.mark.parametrize(("n", "weights"), [(2, None), (3, [3, 1, 2])])
def test_a_replayed_forward_updates_the_running_stats_once(n, weights):
    # A forward that changes parameters in place runs twice on lanes (engine/parallel/replicas/inplace.py):
    # the statistics must still be updated once, from the forward that counts.
    g = torch.Generator().manual_seed(9)
    data = [torch.randint(0, 13, (10, 3), generator=g) for _ in range(3)]

    def train(lanes_n, w, sync):
        model = TiedMaxNormBN().double()
        if sync:
            convert_sync_batchnorm(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        backend = make_backend(lanes(lanes_n))
        try:
            step = ReplicateEachStep(backend)
            for tokens in data:
                opt.zero_grad()
                sizes = chunk_sizes(len(tokens), lanes_n, w)
                step.forward_loss(model, tokens, tokens[:, 0], F.cross_entropy, sizes, PhaseTimer()).loss.backward()
                opt.step()
        finally:
            backend.close()
        return model.state_dict()

    got, ref = train(n, weights, sync=True), train(1, None, sync=False)
    assert max(max_rel(got[k], ref[k]) for k in ref) < 1e-10
    assert got["bn.num_batches_tracked"].item() == 3


if __name__ == "__main__":
    # The measured maxima quoted in docs/design.md: python tests/test_lane_batchnorm.py
    print(f"{'model kind':34} {'loss':>8} {'grads':>8} {'params':>8} {'buffers':>8}")
    for kind in MODELS:
        data = batches(kind, 4, 21)
        ref = plain_loop(kind, data)
        worst = [max(col) for col in zip(*(maxima(lane_loop(kind, data, n, w), ref) for n, w in SPLITS), strict=True)]
        print(f"{kind + ', sync_batchnorm':34} " + " ".join(f"{x:8.1e}" for x in worst))
    data = batches("mlp+bn1d", 3, 16)
    ref = plain_loop("mlp+bn1d", data)
    worst = [
        max(col)
        for col in zip(
            *(maxima(lane_loop("mlp+bn1d", data, len(w), w, sync=False), ref) for w in ([0, 1], [0, 0, 1])), strict=True
        )
    ]
    print(f"{'mlp+bn1d, all on the last lane':34} " + " ".join(f"{x:8.1e}" for x in worst))
