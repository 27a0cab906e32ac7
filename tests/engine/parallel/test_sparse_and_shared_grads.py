"""Sparse, absent, tied and 0-dim parameters and gradients on lanes, every instrument on, equal a hand loop.

The kinds are tests/task_files/param_kinds.py's: ``Embedding(sparse=True)`` (alone, tied to the output
layer, and an ``EmbeddingBag(sparse=True)`` beside a layer no sample uses), a forward that reads
``self.parameters()``, 0-dim parameters. Each run has the fit check, health every step with
activations, the NaN replay's copy, telemetry, two micro-batches a step and clipping; the reference is
the loop a user writes for one device (torch's SGD, the same clipping arithmetic), on the very batches the
trainer takes, in float64.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import TASK_FILES
from multilane.engine.errors import UserError
from multilane.engine.plan.measure import StorageCount
from multilane.engine.run.trainer import Trainer, TrainerCallback
from multilane.engine.tensors.grads import clip_grad_norm, grad_norm, norms, tensor_bytes

KINDS = str(TASK_FILES / "param_kinds.py")
BOUND = 1e-10
STEPS, ACCUM, CLIP = 4, 2, 0.3


@pytest.fixture(autouse=True)
def _fit_check_on(monkeypatch):
    monkeypatch.setenv("MULTILANE_FIT_CHECK", "1")  # every instrument on (the suite turns the fit check off)


class Records(TrainerCallback):
    def __init__(self) -> None:
        self.train: list[dict] = []

    def on_log(self, record: dict) -> None:
        self.train.append(record)


def config(make_config, kind: str, strategy: str, devices: str, weights, optim: str = "sgd"):
    return make_config(
        task__name=KINDS,
        task__params={"kind": kind, "samples": 41},  # 30 to train in batches of 8: a last batch of 6
        devices__use=devices,
        devices__weights=weights or [],
        devices__strategy=strategy,
        train__steps=STEPS,
        train__grad_accum=ACCUM,
        train__grad_clip=CLIP,
        train__fit_check=True,
        data__batch_size=8,
        optim__name=optim,
        optim__lr=0.1,
        optim__momentum=0.9,
        health__every=1,
        telemetry__enabled=True,
    )


def layer_grad_norms(model: torch.nn.Module) -> list[float]:
    """Per layer (a module with parameters of its own), the norm of its gradients, made dense."""
    out = []
    for _, m in model.named_modules():
        own = [p for p in m.parameters(recurse=False) if p.requires_grad]
        if own:
            sq = sum(float(p.grad.to_dense().pow(2).sum()) for p in own if p.grad is not None)
            out.append(sq**0.5)
    return out


def hand_loop(cfg) -> tuple[torch.nn.Module, list[float], list[list[float]]]:
    ref = Trainer(cfg.model_copy(update={"devices": cfg.devices.model_copy(update={"use": "cpu:0", "weights": []})}))
    ref._setup()  # the task, its seeded model, and the very batches the run takes
    ref.backend.close()
    model, task = ref.model, ref.task
    opt = torch.optim.SGD(model.parameters(), lr=cfg.optim.lr, momentum=cfg.optim.momentum)
    losses, layer_norms = [], []
    for s in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for k in range(ACCUM):
            x, y, _ = ref.loader.batches.get(s * ACCUM + k)
            loss = task.loss(model(x), y) / ACCUM
            loss.backward()
            total += loss.item()
        layer_norms.append(layer_grad_norms(model))  # health's per-layer norms: before clipping
        clip_grad_norm(list(model.parameters()), CLIP)  # torch's own where no gradient is sparse
        opt.step()
        losses.append(total)
    return model, losses, layer_norms


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def check_against_hand_loop(make_config, kind: str, strategy: str, devices: str, weights) -> Trainer:
    cfg = config(make_config, kind, strategy, devices, weights)
    ref_model, ref_losses, ref_norms = hand_loop(cfg)
    records = Records()
    trainer = Trainer(cfg, callbacks=[records])
    result = trainer.run()
    assert result.status == "finished", result.message
    assert [r["step"] for r in records.train] == list(range(1, STEPS + 1))
    for r, b in zip(records.train, ref_losses, strict=True):
        assert abs(r["loss"] - b) <= BOUND * abs(b), (kind, strategy, r["step"], r["loss"], b)
        assert r["memory"], "the memory split of every lane at every log"
    for (name, p), q in zip(trainer.model.named_parameters(), ref_model.parameters(), strict=True):
        assert rel(p.detach(), q.detach()) <= BOUND, f"{kind} {strategy} {devices}: {name} differs"
    layers = [json.loads(h) for h in (trainer.run_dir.path / "health_layers.jsonl").read_text().splitlines() if h]
    assert [h["step"] for h in layers] == list(range(1, STEPS + 1)), "every layer's health at every step"
    for h, want in zip(layers, ref_norms, strict=True):  # the records keep 4 significant digits
        got = [g or 0.0 for g in h["grad_norm"]]
        assert all(abs(a - b) <= 6e-4 * b + 1e-12 for a, b in zip(got, want, strict=True)), (kind, got, want)
    return trainer


@pytest.mark.slow
def test_a_sparse_embedding_trains_on_two_persistent_lanes_as_on_one_device(make_config):
    trainer = check_against_hand_loop(make_config, "sparse", "persistent", "cpu:0,cpu:1", [1, 3])
    assert trainer.model.emb.weight.grad.layout == torch.sparse_coo  # kept sparse, as one device's


@pytest.mark.slow
@pytest.mark.parametrize(("devices", "weights"), [("cpu:0,cpu:1", [1, 3]), ("cpu:0,cpu:1,cpu:2", [3, 1, 2])])
@pytest.mark.parametrize("strategy", ["replicate", "persistent"])
@pytest.mark.parametrize("kind", ["sparse", "sparse_tied", "sparse_bag", "paramread", "scalar"])
def test_every_parameter_kind_trains_on_lanes_as_on_one_device(make_config, kind, strategy, devices, weights):
    check_against_hand_loop(make_config, kind, strategy, devices, weights)


@pytest.mark.parametrize("optim", ["adam", "adamw"])
def test_sparse_gradients_with_adam_are_refused_before_anything_starts(make_config, tmp_path, optim):
    cfg = config(make_config, "sparse", "replicate", "cpu:0,cpu:1", None, optim=optim)
    with pytest.raises(UserError) as e:
        Trainer(cfg).run()
    assert f"emb (Embedding(sparse=True)) makes sparse gradients, which optim.name = {optim}" in str(e.value)
    assert "use optim.name = sgd" in str(e.value)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir()), "no run folder"


def test_sparse_gradients_have_norms_bytes_and_clipping_of_their_dense_equal():
    torch.manual_seed(0)
    emb = torch.nn.Embedding(9, 4, sparse=True).double()
    emb(torch.tensor([[1, 2, 1], [7, 1, 3]])).pow(2).sum().backward()
    sparse = emb.weight.grad
    assert not sparse.is_coalesced()  # index 1 three times: a norm of its raw values would be wrong
    dense = sparse.to_dense()
    assert abs(float(norms([sparse])[0]) - float(dense.norm())) <= 1e-15 * float(dense.norm())
    assert tensor_bytes([sparse]) == sparse._indices().nbytes + sparse._values().nbytes
    count = StorageCount()  # the fit check's and the run's peak measure on CPU lanes
    count.add_tensor(sparse)
    assert count.current == tensor_bytes([sparse])
    tied = torch.nn.Linear(4, 4).double()
    assert tensor_bytes([tied.weight, tied.weight, None]) == tied.weight.nbytes  # a tied tensor counted once
    twin = torch.nn.Parameter(emb.weight.detach().clone())
    twin.grad = dense.clone()
    got = clip_grad_norm([emb.weight], 0.5)
    want = torch.nn.utils.clip_grad_norm_([twin], 0.5)
    assert abs(float(got) - float(want)) <= 1e-15 * float(want)
    assert emb.weight.grad.layout == torch.sparse_coo
    assert rel(emb.weight.grad.to_dense(), twin.grad) <= 1e-15


def test_the_logged_gradient_norm_is_torch_s_bit_for_bit_on_dense_mixed_and_sparse_gradients():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    net(torch.randn(4, 5)).square().sum().backward()
    params = list(net.parameters())
    params[1].grad = None  # a parameter no sample reached
    want = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    assert torch.equal(grad_norm(params), want)  # the one-device, one-dtype path: the same arithmetic
    extra = torch.nn.Parameter(torch.randn(3, dtype=torch.float64))
    extra.grad = torch.randn(3, dtype=torch.float64)
    params.append(extra)  # two dtypes: torch's grouping
    want = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    assert torch.equal(grad_norm(params), want)
    emb = torch.nn.Embedding(9, 4, sparse=True).double()
    emb(torch.tensor([[1, 2, 1]])).sum().backward()
    assert abs(float(grad_norm([emb.weight])) - float(emb.weight.grad.to_dense().norm())) <= 1e-15
    assert float(grad_norm([torch.nn.Parameter(torch.ones(2))])) == 0.0  # no gradient at all


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["replicate", "persistent"])
def test_a_nan_in_a_sparse_embedding_is_named_by_the_replay(make_config, strategy):
    cfg = config(make_config, "sparse", strategy, "cpu:0,cpu:1", [1, 3])
    cfg = cfg.model_copy(update={"task": cfg.task.model_copy(update={"params": {"kind": "sparse", "nan_token": 5}})})
    result = Trainer(cfg).run()
    assert result.status != "finished"
    assert "emb.weight" in (result.message or ""), result.message  # the replay ran over sparse gradients


def _step_loop(kind: str, strategy=None, lanes_n: int = 1, weights=None) -> list[list[torch.Tensor | None]]:
    """Three SGD steps of two micro-batches of ``kind`` (param_kinds.py), through ``strategy`` (None: the
    hand loop on one device); every step's gradients (dense copies) and the final weights."""
    from multilane.engine.parallel import chunk_sizes
    from multilane.engine.parallel.timing import PhaseTimer
    from multilane.engine.tasks import make_task

    task = make_task(KINDS, {"kind": kind, "samples": 54})
    torch.manual_seed(3)
    model = task.build_model()
    data = task.data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    timer, out = PhaseTimer(), []
    for s in range(3):
        opt.zero_grad(set_to_none=True)
        for k in range(2):
            idx = torch.arange(9) + 9 * (2 * s + k)
            x, y = data.take(idx)
            if strategy is None:
                (task.loss(model(x), y) / 2).backward()
            else:
                res = strategy.forward_loss(model, x, y, task.loss, chunk_sizes(9, lanes_n, weights), timer)
                strategy.backward(res, res.loss / 2)
        if strategy is not None:
            strategy.reduce_gradients(timer)
        out.append([None if p.grad is None else p.grad.to_dense().clone() for p in model.parameters()])
        opt.step()
        if strategy is not None:
            strategy.sync_replicas(model, timer)
    out.append([p.detach().clone() for p in model.parameters()])
    return out


@pytest.mark.parametrize("kind", ["sparse", "sparse_tied", "sparse_bag"])
def test_gradient_buckets_sum_sparse_gradients_while_backward_runs(kind):
    """``PersistentReplicas(overlap=True)``: the buckets of gradients summed during backward (on GPUs by
    default), here on 3 CPU lanes [3, 1, 2], equal the hand loop's gradients step by step."""
    from multilane.engine.parallel import PersistentReplicas, make_backend
    from multilane.engine.telemetry.devices import parse_devices

    backend = make_backend(parse_devices("cpu:0,cpu:1,cpu:2"))
    strategy = PersistentReplicas(backend, overlap=True)
    try:
        got = _step_loop(kind, strategy, 3, [3, 1, 2])
    finally:
        strategy.close()
        backend.close()
    want = _step_loop(kind)
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        for j, (x, y) in enumerate(zip(a, b, strict=True)):
            assert (x is None) == (y is None), (kind, step, j)
            if x is not None:
                assert rel(x, y) <= BOUND, (kind, step, j, rel(x, y))
