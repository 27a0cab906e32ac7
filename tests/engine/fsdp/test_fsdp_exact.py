"""fsdp in float64 equals one device's full-batch training, to 1e-10.

Each case is one fsdp launch (2 or 3 ranks, even or uneven shares, gradient accumulation over 2
micro-batches, grad clipping by the global norm over every rank's shards) compared with the
single-process engine on ONE device: every logged loss and gradient norm, every validation loss,
every parameter and buffer (read back from the sharded checkpoint). Kinds: the hidden-layer MLP,
the digits CNN, the charlm transformer (token-weighted loss; its text sample, written by rank 0 from
the gathered model, equals one device's too) and a model with tied weights and BatchNorm
(``devices.sync_batchnorm``: full-batch statistics).

What differs in float32 (not asserted here, docs/fsdp.md): the same arithmetic in another order.
FSDP reduce-scatters each rank's gradient of its shard of the batch and the optimizer steps on each
rank's slice of every parameter; one device sums the whole batch's gradient in one backward. float32
keeps ~7 digits, so the sums round differently (relative differences ~1e-7 per step, growing
slowly); bf16 mixed precision also computes with bf16 copies of the parameters (FSDP's
MixedPrecisionPolicy) where one device's autocast keeps some operations in float32.
"""

from __future__ import annotations

import pytest
import torch
from fsdp_helpers import assert_equal_runs, launch, resume, run_dirs, settings, single_process
from multilane.engine.run.trainer import Trainer
from multilane.engine.rundir.runlog import read_metrics

pytestmark = pytest.mark.timeout(600)

CASES = {
    "digits CNN, 2 ranks [1, 3]": ("cnn", "cpu:0,cpu:1", {"weights": [1, 3]}),
    "charlm transformer, 2 ranks": ("charlm", "cpu:0,cpu:1", {}),
    "tied weights + BatchNorm, 3 ranks [3, 1, 2]": (
        "tiedbn",
        "cpu:0,cpu:1,cpu:2",
        {"weights": [3, 1, 2], "sync_batchnorm": True},
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_fsdp_equals_one_device_full_batch_training(tmp_path, case):
    kind, devices, more = CASES[case]
    cfg = settings(kind, 3, devices, **more)
    launch(tmp_path, cfg)
    (run,) = run_dirs(tmp_path / "runs")
    state, records, ref_run = single_process(tmp_path, cfg, "one")
    assert_equal_runs(run, state, records, case)
    # Item 4: each rank holds its shards; together they are one device's parameters, gradients and
    # optimizer state, byte for byte (tied weights once).
    mine = [r for r in read_metrics(run) if r["kind"] == "train"][-1]["memory"]
    (one,) = [r for r in records if r["kind"] == "train"][-1]["memory"].values()
    assert len(mine) == len(devices.split(","))
    for part in ("params", "grads", "optimizer"):
        assert sum(m[part] for m in mine.values()) == one[part], (part, mine, one)
    if kind == "charlm":
        assert (run / "samples.txt").read_text() == (ref_run / "samples.txt").read_text()


@pytest.mark.slow
def test_a_run_resumes_across_strategies_and_device_counts_equal_to_a_straight_run(tmp_path):
    # The hidden-layer MLP: ddp on 2 ranks (step 1), resumed as fsdp on 3 ranks [3, 1, 2] (a full
    # checkpoint into a sharded model, to step 3), as fsdp on 2 (sharded into another sharding, to
    # step 4), then in one process on one device (sharded into a plain model, to step 5): every
    # step's loss and the final weights equal 5 straight steps on one device.
    cfg = settings("mlp", 1, "cpu:0,cpu:1", strategy="ddp")
    launch(tmp_path, cfg)
    (run,) = run_dirs(tmp_path / "runs")
    resume(
        run, "--steps", "3", "--strategy", "fsdp", "--devices", "cpu:0,cpu:1,cpu:2", "--set", "devices.weights=[3,1,2]"
    )
    ck = torch.load(run / "checkpoints" / "last.pt", weights_only=True)
    assert ck["step"] == 3 and ck["model"] == {} and (run / "checkpoints" / ck["sharded"] / ".metadata").is_file()
    resume(run, "--steps", "4", "--devices", "cpu:0,cpu:1", "--set", "devices.weights=[]")
    (folder,) = [p.name for p in (run / "checkpoints").iterdir() if p.is_dir()]  # the older one removed
    assert folder.startswith("sharded-4-")
    trainer = Trainer(
        resume_from=run, overrides={"train.steps": 5, "devices.strategy": "replicate", "devices.use": "cpu:0"}
    )
    assert trainer.run().status == "finished"
    state, records, _ = single_process(tmp_path, settings("mlp", 5, "cpu:0"), "straight")
    assert_equal_runs(run, state, records, "ddp(2) > fsdp(3) > fsdp(2) > one device")
    assert [r["step"] for r in read_metrics(run) if r["kind"] == "train"] == [1, 2, 3, 4, 5]
