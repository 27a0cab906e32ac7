"""LoRA fine-tuning on 2-3 lanes (replicate, persistent; uneven shares) and 2 ranks (ddp, fsdp with the base
frozen) equals a plain one-device transformers + peft loop in float64: every logged loss, the validation
loss and its perplexity, and the adapter weights; a run stopped and resumed equals one straight run."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from multilane.engine.config import build_config
from multilane.engine.data.order import epoch_order, split_indices
from multilane.engine.fsdp.sharded import read_model_state
from multilane.engine.lm.data import IGNORE
from multilane.engine.lm.hf import peft, transformers
from multilane.engine.run.callbacks import HEALTH_LAYERS
from multilane.engine.run.trainer import Trainer
from multilane.engine.rundir.runlog import read_metrics
from multilane.engine.tasks import make_task
from torch.nn import functional as F

BATCH, STEPS, SEED, LR, VAL = 6, 3, 7, 0.02, 0.2


def lm_params(model, data, rank=2, **more):
    return {"model": str(model), "data": [str(data)], "context": 16, "lora_rank": rank, "lora_alpha": 4.0, **more}


def settings(tmp_path, p, devices, strategy, steps=STEPS, weights=()):
    return {
        "run": {"runs_dir": str(tmp_path / "runs"), "name": "lm"},
        "task": {"name": "causal-lm", "params": {**p, "dtype": "float64", "sample_tokens": 4}},
        "devices": {"use": devices, "strategy": strategy, "weights": list(weights)},
        "data": {"batch_size": BATCH, "workers": 0, "val_fraction": VAL},
        "optim": {"name": "adam", "lr": LR},
        "schedule": {"kind": "constant"},
        "train": {"steps": steps, "seed": SEED, "log_every": 1, "eval_every": steps},
        "telemetry": {"enabled": False},
        "health": {"enabled": True, "every": 1},
    }


def reference(p, steps=STEPS):
    """The plain loop: transformers' model, peft's adapters, Adam, one device, the same samples in order."""
    tf, pf = transformers(), peft()
    task = make_task("causal-lm", p)
    data = task.data()
    train_idx, val_idx = split_indices(len(data), VAL, SEED)
    torch.manual_seed(SEED)
    lm = tf.AutoModelForCausalLM.from_pretrained(p["model"], dtype=torch.float64)
    if p["lora_rank"]:
        config = pf.LoraConfig(r=p["lora_rank"], lora_alpha=p["lora_alpha"], task_type="CAUSAL_LM")
        lm = pf.get_peft_model(lm, config)
    opt = torch.optim.Adam([q for q in lm.parameters() if q.requires_grad], lr=LR)

    def batch(idx):
        items = [data[int(i)] for i in idx]
        ids = torch.stack([x["input_ids"] for x, _ in items])
        mask = torch.stack([x["attention_mask"] for x, _ in items])
        return ids, mask, torch.stack([t for _, t in items])

    def loss_of(ids, mask, target):
        logits = lm(input_ids=ids, attention_mask=mask, use_cache=False).logits
        return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=IGNORE)

    n = len(train_idx)
    per_epoch = math.ceil(n / BATCH)
    losses = []
    for m in range(steps):
        epoch, pos = divmod(m, per_epoch)
        order = epoch_order(n, SEED, epoch)[pos * BATCH : (pos + 1) * BATCH]
        loss = loss_of(*batch(train_idx[order]))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        ids, mask, target = batch(val_idx)
        val = loss_of(ids, mask, target).item()
    trained = {k: v.detach() for k, v in lm.named_parameters() if v.requires_grad}
    return losses, val, trained


def assert_matches(run, ref, state, evals=1):
    """The run's train records, its last eval record and ``state``'s trained weights against ``reference``."""
    losses, val, trained = ref
    records = read_metrics(run)
    train = [r for r in records if r["kind"] == "train"]
    ev = [r for r in records if r["kind"] == "eval"][-1]
    assert [r["step"] for r in train] == list(range(1, len(losses) + 1))
    for r, want in zip(train, losses, strict=True):
        assert abs(r["loss"] - want) < 1e-10, (r["loss"], want)
        assert r["tokens_per_s"] > 0 and r["samples_per_s"] > 0
        assert abs(r["tokens_per_s"] / r["samples_per_s"] - 16) < 1e-9
    assert abs(ev["val_loss"] - val) < 1e-10 and abs(ev["perplexity"] - math.exp(val)) < 1e-8 * math.exp(val)
    assert ev["sample"] and (run / "samples.txt").read_text().count("--- step") == evals
    mine = {k.removeprefix("lm."): v for k, v in state.items() if k.removeprefix("lm.") in trained}
    assert mine.keys() == trained.keys() and len(mine) > 0
    for k, v in trained.items():
        assert torch.allclose(mine[k].to(v), v, rtol=0, atol=1e-11), k
    return records


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind, strategy, devices, weights, checkpointing, rank",
    [
        ("gpt2", "replicate", "cpu:0,cpu:1", (1, 2), False, 2),
        ("llama", "persistent", "cpu:0,cpu:1,cpu:2", (2, 1, 3), True, 2),
        ("gpt2", "persistent", "cpu:0,cpu:1,cpu:2", (), False, 0),  # every weight, the head tied to the embeddings
    ],
)
def test_lanes_equal_one_device_and_resume_exactly(
    tmp_path, lm_text, kind, strategy, devices, weights, checkpointing, rank, request
):
    model = request.getfixturevalue(f"tiny_{kind}")
    p = lm_params(model, lm_text, rank, gradient_checkpointing=checkpointing)
    ref = reference(p, STEPS + 1)
    # Two steps, then resumed to the end: one straight run's numbers.
    first = Trainer(build_config(settings(tmp_path, p, devices, strategy, steps=2, weights=weights))).run()
    assert first.status == "finished", first.message
    trainer = Trainer(resume_from=first.run_dir, overrides={"train.steps": STEPS + 1, "train.eval_every": 0})
    result = trainer.run()
    assert result.status == "finished", result.message
    assert_matches(first.run_dir, ref, trainer.model.state_dict(), evals=2)
    # Health names the LoRA layers; the noise scale counts tokens.
    noise = [r["noise"] for r in read_metrics(first.run_dir) if r.get("noise")]
    assert noise and all(n["unit"] == "tokens" for n in noise)
    layers = json.loads((first.run_dir / HEALTH_LAYERS).read_text().splitlines()[-1])["names"]
    if rank:
        assert any("lora_A" in name for name in layers) and any("lora_B" in name for name in layers)
        assert not any("lora" not in name for name in layers)  # the frozen base has no health of its own
    else:
        assert any("wte" in name for name in layers) and any("c_attn" in name for name in layers)


@pytest.mark.slow
@pytest.mark.parametrize("strategy, kind", [("ddp", "gpt2"), ("fsdp", "llama")])
def test_ranks_train_lora_equal_to_one_device(tmp_path, lm_text, strategy, kind, request):
    import tomli_w

    model = request.getfixturevalue(f"tiny_{kind}")
    p = lm_params(model, lm_text)
    cfg = settings(tmp_path, p, "cpu:0,cpu:1", strategy, weights=(1, 2))
    (tmp_path / "run.toml").write_text(tomli_w.dumps(cfg))
    cmd = [sys.executable, "-m", "multilane.engine.cli", "train", "--config", str(tmp_path / "run.toml")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = [d for d in (tmp_path / "runs").iterdir() if d.is_dir()]
    state = read_model_state(run)  # fsdp: its shards, read back whole
    assert_matches(run, reference(p), state)
