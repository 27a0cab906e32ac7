"""The Lightning and Hugging Face callbacks record per-layer health as a native run
does, against a plain float64 loop on the same model and batches (as tests/engine/health does for the
engine): the gradient norm of the whole accumulated step (unscaled, before clipping), the weight norm
and ``‖Δw‖/‖w‖`` of the clipped step, and the mean, std and fraction of zeros of the chosen
activations over every micro-batch of the step. Under Lightning's ddp (two CPU processes) the noise
scale comes from each rank's own gradient, against a hand computation from the ranks' batches."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from integration_runs import logged, records, run_script
from multilane.engine.rundir.runlog import read_json
from torch import nn

F64 = torch.float64
HEALTH = {"every": 1, "activations": "ReLU,Tanh"}
ROWS, ACT_ROWS = ["net.0", "net.2", "net.4"], ["net.1 (ReLU)", "net.3 (Tanh)"]


def net() -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)).to(F64)


def data(n: int = 48) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return torch.randn(n, 5, generator=g, dtype=F64), torch.randn(n, 3, generator=g, dtype=F64)


def flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def reference(model: nn.Sequential, steps: list[list[tuple]], lr: float, clip: float) -> list[dict]:
    """Plain SGD on ``steps`` (each a list of micro-batches), every value by hand in float64."""
    layers = [model[0], model[2], model[4]]
    out = []
    for micro in steps:
        acts: list[list[torch.Tensor]] = [[], []]
        hooks = [
            m.register_forward_hook(lambda _m, _a, o, keep=keep: keep.append(o.detach()))
            for keep, m in zip(acts, (model[1], model[3]), strict=True)
        ]
        model.zero_grad()
        loss = sum(nn.functional.mse_loss(model(x), y) for x, y in micro) / len(micro)
        loss.backward()
        for h in hooks:
            h.remove()
        grads = [torch.cat([p.grad.reshape(-1) for p in k.parameters()]).norm().item() for k in layers]
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        before = [flat(k).clone() for k in layers]
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
        after = [flat(k) for k in layers]
        a = [torch.cat(x) for x in acts]
        out.append(
            {
                "grad_norm": grads,
                "weight_norm": [w.norm().item() for w in after],
                "update_ratio": [((w - b).norm() / w.norm()).item() for w, b in zip(after, before, strict=True)],
                "act_mean": [x.mean().item() for x in a],
                "act_std": [x.std(unbiased=False).item() for x in a],
                "act_zero": [(x == 0).double().mean().item() for x in a],
            }
        )
    return out


def check(run, expect: list[dict]) -> None:
    assert all(sum(g * g for g in r["grad_norm"]) > 0.3**2 for r in expect)  # every step is clipped
    health = records(run, "health")  # the readers accept every record
    assert [r["step"] for r in health] == list(range(1, len(expect) + 1))
    for rec, ref in zip(health, expect, strict=True):
        assert rec["rows"] == ROWS and rec["act_rows"] == ACT_ROWS
        for key, values in ref.items():
            assert rec[key] == pytest.approx(values, rel=1e-3, abs=1e-12), (rec["step"], key)
    full = [json.loads(x) for x in (run / "health_layers.jsonl").read_text().splitlines()]
    assert [f["step"] for f in full] == [r["step"] for r in health] and full[0]["names"] == ROWS
    assert read_json(run / "config.json")["health"]["every"] == 1
    # one process: no noise scale (the view says it needs two or more devices, as for a native run)
    assert not any("noise" in r for r in records(run, "train"))
    assert [r["event"] for r in records(run, "event")] == ["started", "finished"]


# fast tier (every module): its one run of the Lightning callback (lightning.py) in its own
# process; ~4.5 s, of which importing Lightning is ~2 s.
def test_lightning_records_per_layer_health_of_the_accumulated_unscaled_unclipped_step(tmp_path):
    from multilane.integrations.lightning import MultilaneCallback  # isort: skip

    import lightning.pytorch as pl
    from lightning.pytorch.plugins import MixedPrecision
    from torch.utils.data import DataLoader, TensorDataset

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net, self.seen = net(), []

        def training_step(self, batch, batch_idx):
            self.seen.append([t.clone() for t in batch])
            return nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.2)

    module = Module()
    start = copy.deepcopy(module.net)
    # fp16's loss scaling (2^10; a float64 model stays float64 under autocast): Lightning unscales the
    # gradient before on_before_optimizer_step, which the records must not divide again
    amp = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))
    cb = MultilaneCallback(runs_dir=tmp_path / "runs", name="lit", telemetry=False, health=HEALTH)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        plugins=[amp],
        callbacks=[cb],
        max_steps=3,
        accumulate_grad_batches=2,
        gradient_clip_val=0.3,  # clipped after the hook: the records hold the gradient before it
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, DataLoader(TensorDataset(*data()), batch_size=8))
    assert not any(m._forward_hooks for m in module.modules())  # hooked on sampled steps only
    steps = [module.seen[k : k + 2] for k in range(0, 6, 2)]
    check(cb.run_dir, reference(start, steps, lr=0.2, clip=0.3))


@pytest.mark.slow
def test_hugging_face_records_per_layer_health_of_the_accumulated_step_before_its_clipping(tmp_path):
    from multilane.integrations.transformers import MultilaneCallback  # isort: skip

    import transformers

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net, self.seen = net(), []

        def forward(self, x, y):
            if self.training:
                self.seen.append((x.clone(), y.clone()))
            return {"loss": nn.functional.mse_loss(self.net(x), y)}

    x, y = data()
    rows = [{"x": x[i], "y": y[i]} for i in range(len(x))]
    model = Model()
    start = copy.deepcopy(model.net)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"),
        max_steps=3,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        max_grad_norm=0.3,  # the Trainer clips before on_pre_optimizer_step: read before its clipping
        fp16=True,  # the scaled gradient, divided by the accelerator's loss scale
        learning_rate=0.2,
        optim="sgd",
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    cb = MultilaneCallback(runs_dir=tmp_path / "runs", name="hf", telemetry=False, health=HEALTH)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows, callbacks=[cb])
    # fp16's loss scaling as accelerate does it on a GPU (on the CPU it makes no scaler): the same
    # GradScaler, handed to the optimizer it prepares; a float64 model stays float64 under autocast
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    trainer.accelerator.native_amp = True  # as on a GPU: it unscales before the Trainer's clipping
    trainer.train()
    assert trainer.accelerator.scaler.get_scale() == 1024.0  # every step was scaled (and none skipped)
    assert not any(m._forward_hooks for m in model.modules())  # hooked on sampled steps only
    assert "_clip_grad_norm" not in vars(trainer)  # the Trainer's own method again
    steps = [model.seen[k : k + 2] for k in range(0, 6, 2)]
    check(cb.run_dir, reference(start, steps, lr=0.2, clip=0.3))


def rank_dump(tmp_path, rank: int, accum: int) -> tuple[nn.Sequential, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The script's model at the dumped step's start and that rank's micro-batches, in float64."""
    d = torch.load(tmp_path / "out" / f"step2-rank{rank}.pt")
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).to(F64)
    model.load_state_dict({k: v.to(F64) for k, v in d["state"].items()})
    micro = [(x.to(F64), y.to(F64)) for x, y in d["micro"]]
    assert len(micro) == accum
    return model, micro


def noise_by_hand(tmp_path, accum: int) -> tuple[float, float, list[torch.Tensor]]:
    """``(|G|², tr Σ, the step's gradient)`` of the dumped step from the two ranks' micro-batches: each
    rank's loss is the mean of its micro-batches' means, the ranks' gradients averaged (DDP and FSDP
    alike), so a sample weighs 1/(2·16·accum); the unbiased estimates of engine/health/noise_scale.py."""
    grads, q = [], []
    for rank in (0, 1):
        model, micro = rank_dump(tmp_path, rank, accum)
        (sum(nn.functional.mse_loss(model(x), y) for x, y in micro) / accum).backward()
        grads.append([p.grad / 2 for p in model.parameters()])  # this rank's part: half its own
        q.append(sum(len(x) / (2 * len(x) * accum) ** 2 for x, _ in micro))
    h = [a + b for a, b in zip(*grads, strict=True)]
    sq = [sum(g.square().sum().item() for g in gs) for gs in grads]
    total = sum(g.square().sum().item() for g in h)
    a = [0.5, 0.5]  # each rank's share of the step
    g2 = (total - sum(sq)) / (sum(a) ** 2 - sum(x * x for x in a))
    return g2, (sum(sq) - sum(x * x for x in a) * g2) / sum(q), h


@pytest.mark.slow
def test_lightning_ddp_noise_scale_comes_from_each_ranks_gradient_as_a_hand_computation(tmp_path):
    args = ["--devices", "2", "--steps", "2", "--accumulate", "2", "--health-every", "2", "--dump", "2"]
    run = run_script("lightning_script.py", tmp_path, *args)
    g2, trace, h = noise_by_hand(tmp_path, 2)  # each rank's two micro-batches of 16 at step 2
    (rec,) = [r for r in records(run, "train") if r["step"] == 2]
    assert rec["noise"]["batch"] == 64 and rec["noise"]["unit"] == "samples"
    assert rec["noise"]["g2"] == pytest.approx(g2, rel=2e-3)
    assert rec["noise"]["trace"] == pytest.approx(trace, rel=2e-3)
    assert rec["noise"]["b_simple"] == pytest.approx(trace / g2, rel=2e-3)
    # the layers' gradient norms are the combined gradient's
    (health,) = records(run, "health")
    assert health["rows"] == ["net.0", "net.2"] and health["step"] == 2
    layers = [(h[0].square().sum() + h[1].square().sum()).sqrt(), (h[2].square().sum() + h[3].square().sum()).sqrt()]
    assert health["grad_norm"] == pytest.approx([v.item() for v in layers], rel=2e-3)
    # the Tanh's outputs over both ranks' micro-batches (each rank's sums added in the all-reduce), not rank 0's
    with torch.no_grad():
        a = torch.cat([torch.tanh(m[0](x)).flatten() for m, micro in map(lambda r: rank_dump(tmp_path, r, 2), (0, 1))
                       for x, _ in micro])  # fmt: skip
    assert health["act_rows"] == ["net.1 (Tanh)"]
    assert health["act_mean"] == pytest.approx([a.mean().item()], rel=1e-3)
    assert health["act_std"] == pytest.approx([a.std(unbiased=False).item()], rel=1e-3)
    assert not [r for r in records(run, "event") if r["event"] == "noise_scale"]  # measured: no note


@pytest.mark.slow
def test_lightning_fsdp2_health_is_the_whole_layers_from_every_ranks_shards_as_a_hand_computation(tmp_path):
    # Lightning's ModelParallelStrategy, FSDP2 on each Linear and the net: net.2's weight (1 x 16) and
    # bias (1) are one row over two ranks, so rank 1's shards are empty (FSDP2 pads them): the rows
    # must be the whole layer's, never a rank's part or the padding's. One micro-batch a step: the
    # noise scale from each rank's gradient as FSDP's reduce-scatter receives it.
    args = ["--devices", "2", "--strategy", "fsdp2", "--steps", "2", "--health-every", "2"]
    run = run_script("lightning_script.py", tmp_path, *args, "--dump", "2")
    model, micro = rank_dump(tmp_path, 0, 1)
    micro += rank_dump(tmp_path, 1, 1)[1]
    assert torch.equal(flat(model), flat(rank_dump(tmp_path, 1, 1)[0]))  # both ranks start from the same weights
    acts: list[torch.Tensor] = []
    model[1].register_forward_hook(lambda _m, _a, o: acts.append(o.detach()))
    # each rank's loss is its batch's mean; FSDP averages the two ranks' gradients
    (sum(nn.functional.mse_loss(model(x), y) for x, y in micro) / 2).backward()
    layers = [model[0], model[2]]
    grads = [torch.cat([p.grad.reshape(-1) for p in k.parameters()]).norm().item() for k in layers]
    before = [flat(k).clone() for k in layers]
    after = [
        b - 0.05 * torch.cat([p.grad.reshape(-1) for p in k.parameters()]) for b, k in zip(before, layers, strict=True)
    ]
    a = torch.cat(acts)
    (health,) = records(run, "health")
    assert health["step"] == 2 and health["rows"] == ["net.0", "net.2"] and health["act_rows"] == ["net.1 (Tanh)"]
    assert health["grad_norm"] == pytest.approx(grads, rel=1e-3)
    assert health["weight_norm"] == pytest.approx([w.norm().item() for w in after], rel=1e-3)
    ratios = [((w - b).norm() / w.norm()).item() for w, b in zip(after, before, strict=True)]
    assert health["update_ratio"] == pytest.approx(ratios, rel=1e-3)
    assert health["act_mean"] == pytest.approx([a.mean().item()], rel=1e-3)  # every rank's micro-batches
    assert health["act_std"] == pytest.approx([a.std(unbiased=False).item()], rel=1e-3)
    # each rank's loss and their mean, as under ddp; the run says fsdp and why no noise scale
    train = records(run, "train")
    for rank in (0, 1):
        (mine,) = [m["loss"] for m in logged(tmp_path, rank) if m["step"] == 2]
        (key,) = [k for k in train[-1]["device_loss"] if f"/rank{rank}/" in k]
        assert train[-1]["device_loss"][key] == mine
    assert train[-1]["loss"] == pytest.approx(sum(train[-1]["device_loss"].values()) / 2, rel=1e-12)
    assert read_json(run / "config.json")["devices"]["strategy"] == "fsdp"
    g2, trace, _ = noise_by_hand(tmp_path, 1)
    assert train[-1]["noise"]["batch"] == 32 and train[-1]["noise"]["unit"] == "samples"
    assert train[-1]["noise"]["g2"] == pytest.approx(g2, rel=2e-3)
    assert train[-1]["noise"]["trace"] == pytest.approx(trace, rel=2e-3)
    assert [r["event"] for r in records(run, "event")] == ["started", "finished"]  # no health_off, no note
    assert any("/rank0/cpu:0" in k for r in records(run, "telemetry") for k in r["devices"])  # the engine's sampler
