"""Persistent replicas on the model kinds of tests/exactness_kinds.py: the same plain full-batch loop, the same bound.

Each kind of tests/exactness_kinds.py (token-mean losses with their own normalizer, class weights,
masks, a forward that changes a parameter in place, a penalty over ``self.parameters()``, structured
outputs, dict inputs, tied and unused parameters, LSTM, accumulation, clipping) trains through
PersistentReplicas as the trainer calls it and is compared with test_exactness.py's hand-written loop.
"""

from __future__ import annotations

import math

import pytest
import torch
from exactness_kinds import KINDS
from multilane.engine.parallel import PersistentReplicas, chunk_sizes, make_backend
from multilane.engine.parallel.timing import PhaseTimer
from multilane.engine.run.trainer import Trainer
from test_exactness import BOUND, lanes, max_differences, reference
from test_exactness_trainer import Records, config, hand_loop, rel

SPLITS = {"2 [1,3]": (2, [1, 3]), "3 even": (3, None)}


def on_persistent(name: str, n: int, weights: list[int] | None) -> dict:
    kind = KINDS[name]
    backend = make_backend(lanes(n))
    strategy = PersistentReplicas(backend)
    timer = PhaseTimer()
    model = kind.model()
    opt = kind.optimizer(model.parameters())
    losses, grads = [], []
    try:
        for step in range(len(kind.batches) // kind.accum):
            opt.zero_grad(set_to_none=True)
            for k in range(kind.accum):
                inputs, target = kind.batches[step * kind.accum + k]
                sizes = chunk_sizes(len(target[0] if isinstance(target, tuple) else target), n, weights)
                out = strategy.forward_loss(model, inputs, target, kind.loss, sizes, timer, weight_fn=kind.weight)
                strategy.backward(out, out.loss / kind.accum if kind.accum > 1 else out.loss)
                losses.append(out.loss.detach())
            strategy.reduce_gradients(timer)
            if kind.clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), kind.clip)
            grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
            opt.step()
            strategy.sync_replicas(model, timer)
    finally:
        strategy.close()
        backend.close()
    return {"losses": losses, "grads": grads, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("name", list(KINDS))
def test_persistent_replicas_equal_a_plain_full_batch_loop(name, split):
    n, weights = SPLITS[split]
    diffs = max_differences(on_persistent(name, n, weights), reference(name))
    assert all(math.isfinite(v) for v in diffs.values()), diffs
    assert max(diffs.values()) <= BOUND, diffs


@pytest.mark.parametrize("task", ["padded_tokens.py", "tied_maxnorm.py"])
def test_custom_task_files_train_on_persistent_replicas_as_on_one_device(make_config, task):
    cfg = config(make_config, task, "cpu:0,cpu:1,cpu:2", [3, 1, 2])
    cfg.devices.strategy = "persistent"
    ref_model, ref_losses, ref_val = hand_loop(cfg)
    records = Records()
    trainer = Trainer(cfg, callbacks=[records])
    result = trainer.run()
    assert result.status == "finished", result.message
    assert max(rel(r["loss"], b) for r, b in zip(records.train, ref_losses, strict=True)) <= BOUND
    for (name, p), q in zip(trainer.model.named_parameters(), ref_model.parameters(), strict=True):
        assert ((p - q).abs().max() / q.abs().max()).item() <= BOUND, name
    assert rel(records.eval[-1]["val_loss"], ref_val) <= BOUND
