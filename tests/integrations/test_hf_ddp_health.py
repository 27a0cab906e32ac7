"""Run health under the Hugging Face Trainer's ddp (two CPU processes under torchrun): the gradient noise
scale from each rank's own gradient (a DDP communication hook, before the all-reduce), against a hand
computation from the batches each rank's model saw, where the Trainer's loss weighting is per sample;
where it is not (a model that takes ``num_items_in_batch``, label smoothing), the reason."""

from __future__ import annotations

import json

import pytest
import torch
from integration_runs import records, run_script
from torch import nn

F64 = torch.float64


def model64() -> nn.Sequential:
    """transformers_script.py's Regression at its start (the same seed), in float64."""
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)).to(F64)


def by_hand(model: nn.Sequential, micro: list[list[tuple]], world: int) -> tuple[list, float, float]:
    """One step: ``micro[r]`` rank r's micro-batches. The Trainer divides each micro-batch's mean loss
    by the step's micro-batches, DDP averages the ranks: a sample on rank r weighs 1/(world·b·accum).
    Returns the step's gradient and the unbiased (|G|², tr Σ) of engine/health/noise_scale.py."""
    own, a, q = [], [], []
    for batches in micro:
        model.zero_grad()
        accum = len(batches)
        (sum(nn.functional.mse_loss(model(x), y) for x, y in batches) / (accum * world)).backward()
        own.append([p.grad.clone() for p in model.parameters()])
        a.append(sum(len(x) / (world * len(x) * accum) for x, _ in batches))
        q.append(sum(len(x) / (world * len(x) * accum) ** 2 for x, _ in batches))
    step = [sum(g) for g in zip(*own, strict=True)]
    sq = [sum(g.square().sum().item() for g in gs) for gs in own]
    total = sum(g.square().sum().item() for g in step)
    g2 = (total - sum(sq)) / (sum(a) ** 2 - sum(x * x for x in a))
    return step, g2, (sum(sq) - sum(x * x for x in a) * g2) / sum(q)


@pytest.mark.slow
def test_hf_ddp_noise_scale_comes_from_each_ranks_gradient_as_a_hand_computation(tmp_path):
    # 44 samples in batches of 8 taken by the ranks in turn: rank 0 sees 8, 8, 8 and rank 1 8, 8, 4.
    # Step 1 accumulates two micro-batches on each rank; step 2 is the epoch's last, one micro-batch,
    # 8 samples on rank 0 and 4 on rank 1 (each rank's loss is its own batch's mean).
    args = ["--model", "mlp", "--steps", "2", "--accumulate", "2", "--health-every", "1"]
    run = run_script("transformers_script.py", tmp_path, *args, procs=2)
    seen = [[(x.to(F64), y.to(F64)) for x, y in torch.load(tmp_path / "out" / f"seen-rank{r}.pt")] for r in (0, 1)]
    assert [[len(x) for x, _ in s] for s in seen] == [[8, 8, 8], [8, 8, 4]]
    model = model64()
    first, g2_1, tr_1 = by_hand(model, [s[:2] for s in seen], 2)
    with torch.no_grad():  # plain SGD, lr 0.2, no clipping
        for p, g in zip(model.parameters(), first, strict=True):
            p -= 0.2 * g
    second, g2_2, tr_2 = by_hand(model, [s[2:] for s in seen], 2)
    train = records(run, "train")
    assert [r["step"] for r in train] == [1, 2]
    # the records carry the steps' estimates averaged, each weighted by its batch (32, then 12) and the
    # earlier one decayed by health.noise_decay (0.99); the batch beside them is the steps' mean
    w1, w2 = 0.99 * 32, 12
    want = [
        (g2_1, tr_1, 32, 32),
        ((w1 * g2_1 + w2 * g2_2) / (w1 + w2), (w1 * tr_1 + w2 * tr_2) / (w1 + w2), (w1 + w2) / 1.99, 12),
    ]
    for rec, (g2, trace, mean_batch, batch) in zip(train, want, strict=True):
        assert rec["noise"]["g2"] == pytest.approx(g2, rel=2e-3)
        assert rec["noise"]["trace"] == pytest.approx(trace, rel=2e-3)
        assert rec["noise"]["batch"] == pytest.approx(mean_batch, rel=1e-3) and rec["noise"]["unit"] == "samples"
        # the samples the step trained on over both ranks (32, then 8 + 4), not the nominal 32 each
        assert rec["samples_per_s"] == pytest.approx(batch / (rec["step_ms"] / 1000))
    for rec, grad in zip(records(run, "health"), (first, second), strict=True):  # the combined gradient's
        norms = [(grad[k].square().sum() + grad[k + 1].square().sum()).sqrt().item() for k in (0, 2, 4)]
        assert rec["grad_norm"] == pytest.approx(norms, rel=2e-3)
    history = [h for h in json.loads((tmp_path / "out" / "log_history.json").read_text()) if "loss" in h]
    assert [r["loss"] for r in train] == [h["loss"] for h in history]  # the Trainer's, over the ranks
    assert not any("device_loss" in r for r in train)
    assert [r["event"] for r in records(run, "event")] == ["started", "finished"]  # measured: no note


@pytest.mark.slow
def test_hf_loss_weighting_decides_whether_the_noise_scale_is_measured():
    from multilane.integrations.transformers import per_sample_weighting  # isort: skip

    import transformers
    from transformers_script import Regression, rows

    def trainer(model: nn.Module, **kw) -> transformers.Trainer:
        args = transformers.TrainingArguments(output_dir="/tmp/unused", use_cpu=True, report_to=[], **kw)
        return transformers.Trainer(model=model, args=args, train_dataset=rows(8))

    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0
        )
    )
    assert per_sample_weighting(trainer(Regression()), None) is None  # its forward takes no loss kwargs
    tokens = per_sample_weighting(trainer(gpt2), torch.tensor(40))  # GPT-2 takes num_items_in_batch
    assert tokens is not None and "num_items_in_batch" in tokens
    assert per_sample_weighting(trainer(gpt2), None) is None  # a batch without labels: the plain mean
    smoothing = per_sample_weighting(trainer(gpt2, label_smoothing_factor=0.1), None)
    assert smoothing is not None and "label smoothing" in smoothing
