"""Persistent replicas give the answers of full-batch training and of ReplicateEachStep, step after step."""

import copy

import pytest
import torch
from helpers import Float64Task, max_rel_diff
from multilane.engine.errors import UserError
from multilane.engine.parallel import PersistentReplicas, ReplicateEachStep, chunk_sizes, make_backend
from multilane.engine.parallel.replicas.inplace_watch import InplaceForwardError
from multilane.engine.parallel.timing import PhaseTimer
from multilane.engine.run.control import RunControl
from multilane.engine.run.trainer import Trainer, TrainerCallback
from multilane.engine.rundir.runlog import read_metrics
from multilane.engine.telemetry.devices import parse_devices
from torch import nn
from torch.nn import functional as F

STRATEGIES = {
    "replicate": ReplicateEachStep,
    "persistent": PersistentReplicas,
    "persistent-overlap": lambda backend, *a: PersistentReplicas(backend, *a, overlap=True),
}


def lanes(n):
    return parse_devices(",".join(f"cpu:{i}" for i in range(n)))


def mlp():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 3)).double()


def bn_net():
    torch.manual_seed(2)
    return nn.Sequential(nn.Linear(10, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3)).double()


def batches(n, batch=37):
    out = []
    for s in range(n):
        g = torch.Generator().manual_seed(s)
        out.append(
            (
                torch.randn(batch, 10, generator=g, dtype=torch.float64),
                torch.randn(batch, 3, generator=g, dtype=torch.float64),
            )
        )
    return out


def reference(make, data, opt=lambda p: torch.optim.Adam(p, lr=0.01)):
    model = make()
    o = opt(model.parameters())
    for x, y in data:
        o.zero_grad()
        F.mse_loss(model(x), y).backward()
        o.step()
    return model


def train(strategy, n, make, data, weights=None, opt=lambda p: torch.optim.Adam(p, lr=0.01), after_step=None):
    """The trainer's step, as it calls a strategy: forward_loss, backward, reduce, optimizer, sync."""
    model = make()
    o = opt(model.parameters())
    backend = make_backend(lanes(n))
    s = STRATEGIES[strategy](backend)
    timer = PhaseTimer()
    try:
        for x, y in data:
            out = s.forward_loss(model, x, y, F.mse_loss, chunk_sizes(len(x), n, weights), timer)
            o.zero_grad(set_to_none=True)
            s.backward(out, out.loss)
            s.reduce_gradients(timer)
            o.step()
            s.sync_replicas(model, timer)
            timer.end_step()
            if after_step is not None:
                after_step(s, model)
    finally:
        s.close()
        backend.close()
    return model


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize(
    "opt",
    [lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1)],
    ids=["sgd-momentum", "adamw"],
)
@pytest.mark.parametrize("strategy", ["persistent", "persistent-overlap"])
def test_persistent_replicas_equal_full_batch_training(n, opt, strategy):
    data = batches(6)
    assert max_rel_diff(train(strategy, n, mlp, data, opt=opt), reference(mlp, data, opt)) < 1e-10


@pytest.mark.parametrize("weights", [[3, 1], [1, 2, 5], [0, 1], [1, 0, 2]])
@pytest.mark.parametrize("strategy", ["persistent", "persistent-overlap"])
def test_uneven_splits_and_idle_lanes_equal_full_batch_training(weights, strategy):
    data = batches(6)
    got = train(strategy, len(weights), mlp, data, weights)
    assert max_rel_diff(got, reference(mlp, data)) < 1e-10


def test_buckets_are_summed_during_backward_and_the_hooks_leave_with_the_strategy():
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(300, 300) for _ in range(6))).double()  # > 1 MB: several buckets
    backend = make_backend(lanes(2))
    s = PersistentReplicas(backend, overlap=True)
    x, y = torch.randn(8, 300, dtype=torch.float64), torch.randn(8, 300, dtype=torch.float64)
    out = s.forward_loss(model, x, y, F.mse_loss, [4, 4], PhaseTimer())
    s.backward(out, out.loss)
    assert len(s._buckets.buckets) > 1
    assert all(p.grad is None for p in s.replicas()[1].parameters())  # summed and cleared in backward
    ref = copy.deepcopy(model)
    ref.zero_grad()
    F.mse_loss(ref(x), y).backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert (p.grad - q.grad).abs().max() <= 1e-12 * q.grad.abs().max()
    s.close()
    backend.close()
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())


def test_a_batch_smaller_than_the_lane_count_trains_on_the_lanes_it_fills():
    data = batches(4, batch=2)
    assert max_rel_diff(train("persistent", 3, mlp, data), reference(mlp, data)) < 1e-10


def test_every_replica_is_bitwise_the_model_after_every_step():
    checked = []

    def identical(s, model):
        replicas = s.replicas()
        assert len(replicas) == 3 and replicas[0] is model
        ref = model.state_dict()
        for r in replicas[1:]:
            for k, v in r.state_dict().items():
                assert torch.equal(v, ref[k]), k
            assert all(p.grad is None for p in r.parameters())
        checked.append(1)

    train("persistent-overlap", 3, bn_net, batches(40, batch=23), [2, 1, 1], after_step=identical)
    assert len(checked) == 40


def test_batchnorm_matches_replicate_each_step_weights_and_running_stats():
    # SGD, not Adam: the bias before BatchNorm has a gradient that is 0 in exact arithmetic, and Adam
    # turns its rounding noise (different in any two summation orders) into full-size steps.
    data = batches(8)
    sgd = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)  # noqa: E731
    a = train("persistent", 3, bn_net, data, opt=sgd)
    b = train("replicate", 3, bn_net, data, opt=sgd)
    assert max_rel_diff(a, b) < 1e-10
    for k, v in b.state_dict().items():
        torch.testing.assert_close(a.state_dict()[k], v, rtol=1e-10, atol=0)


def test_replicas_are_built_once_and_reused():
    model = mlp()
    backend = make_backend(lanes(2))
    s = PersistentReplicas(backend)
    x, y = batches(1)[0]
    s.forward_loss(model, x, y, F.mse_loss, [20, 17], PhaseTimer())
    first = s.replicas()
    s.forward_loss(model, x, y, F.mse_loss, [20, 17], PhaseTimer())
    assert all(a is b for a, b in zip(first, s.replicas(), strict=True))
    assert first[1] is not model and first[1][0].weight is not model[0].weight
    backend.close()


def test_weights_changed_outside_a_step_reach_the_replicas_before_the_next_forward():
    model = mlp()
    backend = make_backend(lanes(2))
    s = PersistentReplicas(backend)
    x, y = batches(1)[0]
    s.forward_loss(model, x, y, F.mse_loss, [20, 17], PhaseTimer())
    other = mlp()
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(2)
    model.load_state_dict(other.state_dict())
    out = s.forward_loss(model, x, y, F.mse_loss, [20, 17], PhaseTimer())
    assert out.loss.item() == pytest.approx(F.mse_loss(other(x), y).item(), rel=1e-12)
    backend.close()


def test_evaluation_sees_the_models_eval_mode_on_every_replica():
    model = bn_net()
    backend = make_backend(lanes(3))
    s = PersistentReplicas(backend)
    x, y = batches(1)[0]
    s.forward_loss(model, x, y, F.mse_loss, [13, 12, 12], PhaseTimer())  # build replicas in train mode
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(s.forward(model, x, [13, 12, 12]), model(x), rtol=1e-12, atol=0)
    model.train()
    s.forward(model, x, [13, 12, 12])
    assert all(r.training for r in s.replicas())
    backend.close()


def test_bf16_sums_each_lanes_fp32_gradient_exactly():
    """bf16: each lane computes its shard under autocast on its own replica; the reduce adds their fp32
    gradients. The result is bitwise the hand-written sum of per-shard backward passes."""

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3))

    x, y = (t.float() for t in batches(1)[0])
    ref = make()
    grads = []
    for shard, weight in ((slice(0, 19), 19 / 37), (slice(19, 37), 18 / 37)):
        ref.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.mse_loss(ref(x[shard]), y[shard]).float()
        (loss * weight).backward()
        grads.append([p.grad.clone() for p in ref.parameters()])
    model = make()
    backend = make_backend(lanes(2))
    s = PersistentReplicas(backend, "bf16")
    out = s.forward_loss(model, x, y, F.mse_loss, [19, 18], PhaseTimer())
    s.backward(out, out.loss)
    s.reduce_gradients(PhaseTimer())
    backend.close()
    for p, a, b in zip(model.parameters(), *grads, strict=True):
        assert torch.equal(p.grad, a + b)


# -- through the trainer ---------------------------------------------------------------------------
class StopAt(TrainerCallback):
    def __init__(self, control, step):
        self.control, self.step = control, step

    def on_log(self, r):
        if r["step"] == self.step:
            self.control.request_stop()


@pytest.mark.parametrize("accum", [1, 3])
def test_the_trainer_on_persistent_replicas_equals_one_lane(make_config, accum):
    def run(devices, strategy):
        cfg = make_config(
            devices__use=devices,
            devices__strategy=strategy,
            train__steps=6,
            train__grad_accum=accum,
            train__grad_clip=0.5,
            data__batch_size=13,
        )
        trainer = Trainer(cfg, task=Float64Task())
        assert trainer.run().status == "finished"
        return trainer

    one = run("cpu:0", "replicate")
    three = run("cpu:0,cpu:1,cpu:2", "persistent")
    assert max_rel_diff(three.model, one.model) < 1e-10
    rec = [r for r in read_metrics(three.run_dir.path) if r["kind"] == "train"][-1]
    assert rec["phase_ms"]["reduce"] > 0 and rec["phase_ms"]["replicate"] > 0
    assert len(rec["device_loss"]) == 3


@pytest.mark.parametrize(("first", "second"), [("persistent", "replicate"), ("replicate", "persistent")])
def test_a_run_stopped_under_one_strategy_resumes_under_the_other(make_config, first, second):
    cfg = make_config(task__name="digits", train__steps=12, data__batch_size=32, devices__strategy=first)
    straight = Trainer(cfg)
    straight.run()
    control = RunControl()
    stopped = Trainer(cfg, callbacks=[StopAt(control, 5)], control=control).run()
    assert stopped.status == "stopped"
    resumed = Trainer(resume_from=stopped.run_dir, overrides={"devices.strategy": second})
    assert resumed.run().status == "finished"
    assert max_rel_diff(resumed.model, straight.model) < 1e-5  # float32 digits: the gradient sum's order


def test_an_unknown_strategy_is_one_clear_line(make_config):
    with pytest.raises(UserError, match=r"devices\.strategy = \"ring\""):
        make_config(devices__strategy="ring")


def test_a_model_that_cannot_be_copied_fails_the_run_with_one_line(make_config):
    class Uncopyable(Float64Task):
        def build_model(self):
            m = super().build_model()
            m.lock = __import__("threading").Lock()  # deepcopy cannot copy a lock
            return m

    cfg = make_config(devices__strategy="persistent", train__steps=2)
    result = Trainer(cfg, task=Uncopyable()).run()
    assert result.status == "failed" and 'devices.strategy = "replicate"' in result.message


def test_a_parameter_that_starts_changing_in_place_after_the_first_step_is_refused_with_one_line():
    class LateMaxNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(20, 4)
            self.out = nn.Linear(4, 3)

        def forward(self, idx):
            return self.out(self.emb(idx))

    torch.manual_seed(0)
    model = LateMaxNorm()
    backend = make_backend(lanes(2))
    s = PersistentReplicas(backend)
    idx, y = torch.randint(0, 20, (8,)), torch.randn(8, 3)
    s.forward_loss(model, idx, y, F.mse_loss, [4, 4], PhaseTimer())  # learns: nothing changes in place
    for r in s.replicas():
        r.emb.max_norm = 0.5  # from now on every lane's forward renormalizes rows in place
    with pytest.raises(
        InplaceForwardError, match=r"parameter 'emb\.weight' in place after the first step.*strategy = \"replicate\""
    ):
        s.forward_loss(model, idx, y, F.mse_loss, [4, 4], PhaseTimer())
    backend.close()


def test_an_in_place_forward_that_runs_again_updates_batchnorm_once_as_replicate_does():
    class MaxNormBN(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(20, 4, max_norm=0.5)
            self.bn = nn.BatchNorm1d(4)
            self.out = nn.Linear(4, 20)
            self.out.weight = self.emb.weight  # tied: a lane reads rows other lanes renormalized

        def forward(self, idx):
            return self.out(self.bn(self.emb(idx)))

    def run(strategy):
        torch.manual_seed(0)
        model = MaxNormBN().double()
        with torch.no_grad():
            model.emb.weight.mul_(3)  # rows above max_norm: every forward renormalizes some
        o = torch.optim.SGD(model.parameters(), lr=0.1)
        backend = make_backend(lanes(2))
        s = STRATEGIES[strategy](backend)
        g = torch.Generator().manual_seed(1)
        for _ in range(4):
            idx, y = torch.randint(0, 20, (10,), generator=g), torch.randint(0, 20, (10,), generator=g)
            out = s.forward_loss(model, idx, y, F.cross_entropy, [5, 5], PhaseTimer())
            o.zero_grad()
            s.backward(out, out.loss)
            s.reduce_gradients(PhaseTimer())
            o.step()
            s.sync_replicas(model, PhaseTimer())
        backend.close()
        return model.state_dict()

    a, b = run("persistent"), run("replicate")
    assert a["bn.num_batches_tracked"].item() == 4  # one update per step, though every forward ran twice
    for k, v in b.items():
        torch.testing.assert_close(a[k], v, rtol=1e-10, atol=1e-12, msg=k)
