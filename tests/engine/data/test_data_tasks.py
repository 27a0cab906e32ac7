"""The built-in tasks that read real data: charlm (bytes of a text file) and imagefolder (PNG files)."""

from __future__ import annotations

import math
import sys

import pytest
import torch
from multilane.engine.config import build_config
from multilane.engine.errors import UserError
from multilane.engine.run.trainer import Trainer
from multilane.engine.rundir.runlog import read_metrics
from multilane.engine.tasks import make_task
from multilane.engine.tasks.charlm import IGNORE, ByteLines, default_corpus, pack_lines, pad_collate
from multilane.engine.tasks.imagefolder import torchvision_or_hint
from torch.nn import functional as F


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    # One lane runs in the test's own thread; on a loaded 2-core machine two OpenMP threads spinning
    # against other processes made a 30-step charlm run take 30 s instead of 1 s (lanes use one each).
    torch.set_num_threads(1)


def config(tmp_path, task, params, lanes=1, **train):
    return build_config(
        {
            "run": {"runs_dir": str(tmp_path / "runs"), "name": task},
            "task": {"name": task, "params": params},
            "devices": {"use": ",".join(f"cpu:{i}" for i in range(lanes))},
            "data": {"batch_size": 16, "workers": 0},
            "optim": {"lr": 3e-3},
            "train": {"log_every": 1, "eval_every": 0, **train},
            "telemetry": {"enabled": False},
        }
    )


def train_losses(run_dir):
    return [r["loss"] for r in read_metrics(run_dir) if r["kind"] == "train"]


# -- charlm -----------------------------------------------------------------------------------------


def test_the_shipped_corpus_is_packed_into_lines_of_varying_length():
    text = default_corpus().read_bytes()
    assert 10_000 < len(text) < 400_000
    assert (default_corpus().parent / "corpus.LICENSE.md").exists()
    spans = pack_lines(text, 65)
    assert spans[0][0] == 0 and spans[-1][1] == len(text)
    assert all(a < b <= a + 65 for a, b in spans)
    assert len({b - a for a, b in spans}) > 20  # lengths vary
    ds = ByteLines(text, 65)
    x, y = ds[3]
    assert torch.equal(x[1:], y[:-1])


def test_padding_is_ignored_by_the_loss():
    task = make_task("charlm", {"context": 16, "layers": 1, "width": 16, "heads": 2, "dropout": 0.0})
    model = task.build_model()
    samples = [(torch.randint(0, 256, (n,)), torch.randint(0, 256, (n,))) for n in (3, 16, 9)]
    inputs, target = pad_collate(samples)
    assert inputs.shape == (3, 16) and int((target != IGNORE).sum()) == 28
    assert int(task.loss_weight(None, target)) == 28
    padded = task.loss(model(inputs), target)
    # The mean over every real next-byte prediction, each sample run alone without padding.
    per_token = torch.cat([F.cross_entropy(model(x[None])[0], y, reduction="none") for x, y in samples])
    assert abs(padded.item() - per_token.mean().item()) < 1e-5


@pytest.mark.parametrize("lanes", [1, 2])
def test_charlm_trains_and_writes_text_at_evaluation(tmp_path, lanes):
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("the cat sat on the mat.\nthe dog sat on the log.\n" * 40)
    params = {"path": str(corpus), "context": 32, "layers": 1, "width": 32, "heads": 2, "sample_bytes": 40}
    cfg = config(tmp_path, "charlm", params, lanes=lanes, steps=30, eval_every=15)
    result = Trainer(cfg).run()
    assert result.status == "finished", result.message
    losses = train_losses(result.run_dir)
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5
    ev = result.last_eval
    assert math.isclose(ev["metrics"]["bits_per_byte"], ev["val_loss"] / math.log(2), rel_tol=1e-5)
    assert ev["metrics"]["bits_per_byte"] < 8.0  # below the 8 bits of a uniform guess
    samples = (result.run_dir / "samples.txt").read_text()
    assert samples.count("--- step ") == 2 and isinstance(ev["sample"], str) and len(ev["sample"]) > 0


def test_charlm_with_dropout_and_activation_checkpointing_trains_on_the_shipped_corpus(tmp_path):
    params = {"context": 32, "layers": 2, "width": 32, "heads": 4, "dropout": 0.1, "checkpointing": True}
    result = Trainer(config(tmp_path, "charlm", params, steps=20)).run()
    assert result.status == "finished", result.message
    losses = train_losses(result.run_dir)
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5


def test_charlm_names_a_missing_file_and_a_bad_head_count():
    with pytest.raises(UserError, match=r"task charlm: path = '/no/such\.txt': no such file"):
        make_task("charlm", {"path": "/no/such.txt"}).data()
    with pytest.raises(UserError, match="width 30 must be a multiple of heads 4"):
        make_task("charlm", {"width": 30, "heads": 4})


# -- imagefolder ------------------------------------------------------------------------------------


def make_images(root, per_class=12, size=16, seed=0):
    """Two classes of small PNGs: reddish and bluish noise."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    for k, name in enumerate(("red", "blue")):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            img = torch.rand(size, size, 3, generator=g) * 0.5
            img[..., 0 if k == 0 else 2] += 0.5
            Image.fromarray((img * 255).to(torch.uint8).numpy()).save(root / name / f"{i}.png")
    return root


@pytest.mark.slow
def test_imagefolder_trains_a_resnet_on_generated_pngs_with_workers(tmp_path):
    torchvision_or_hint()  # the [vision] extra; the test extra installs it
    root = make_images(tmp_path / "images")
    params = {"root": str(root), "image_size": 16}
    cfg = config(tmp_path, "imagefolder", params, lanes=2, steps=10, eval_every=10)
    cfg = build_config(
        {**cfg.to_dict(), "data": {"batch_size": 8, "workers": 2, "val_fraction": 0.25}, "optim": {"lr": 1e-3}}
    )
    result = Trainer(cfg).run()
    assert result.status == "finished", result.message
    losses = train_losses(result.run_dir)
    # Per-step losses of a ResNet on 4 images a lane jump about; their mean over the second half is
    # well below the first step's (seen: 0.72 -> 0.2-0.3), and the held-out images are told apart.
    assert sum(losses[5:]) / 5 < 0.75 * losses[0]
    assert result.last_eval["metrics"]["accuracy"] >= 0.8


def test_imagefolder_with_train_and_val_folders_augments_only_training(tmp_path):
    torchvision_or_hint()
    make_images(tmp_path / "images" / "train", per_class=6)
    make_images(tmp_path / "images" / "val", per_class=2, seed=1)
    task = make_task("imagefolder", {"root": str(tmp_path / "images"), "image_size": 16, "augment": True})
    train, val = task.data()
    assert len(train) == 12 and len(val) == 4
    assert "RandomResizedCrop" in repr(train.transform) and "RandomResizedCrop" not in repr(val.transform)
    assert task.build_model()(torch.randn(2, 3, 16, 16)).shape == (2, 2)


def test_imagefolder_refuses_bad_folders_in_one_line(tmp_path):
    torchvision_or_hint()
    with pytest.raises(UserError, match=r"set task\.params\.root"):
        make_task("imagefolder").data()
    with pytest.raises(UserError, match="no such folder"):
        make_task("imagefolder", {"root": str(tmp_path / "nope")}).data()
    make_images(tmp_path / "one", per_class=2)
    with pytest.raises(UserError, match="augment needs root/train and root/val"):
        make_task("imagefolder", {"root": str(tmp_path / "one"), "augment": True}).data()


def test_imagefolder_without_torchvision_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchvision", None)  # what Python does when it is not installed
    with pytest.raises(UserError, match=r'pip install "torch==[^"]+" -e "\.\[vision\]"'):
        make_task("imagefolder", {"root": "."}).build_model()


def test_charlm_weights_lanes_by_real_tokens_so_lane_count_does_not_change_the_loss(tmp_path):
    """Shards hold different numbers of real bytes; weighted by samples, 2 lanes gave 5.65666 against 1
    lane's 5.65661 at step 1 and drifted further (1.5e-4 by step 3). Weighted by tokens (loss_weight)
    they agree to float32 rounding."""
    params = {"context": 32, "layers": 1, "width": 32, "heads": 2, "dropout": 0.0, "sample_bytes": 0}
    runs = {}
    for lanes in (1, 2, 3):
        result = Trainer(config(tmp_path, "charlm", params, lanes=lanes, steps=3, eval_every=3)).run()
        runs[lanes] = (train_losses(result.run_dir), result.last_eval["val_loss"])
    ref_losses, ref_val = runs[1]
    for lanes in (2, 3):
        losses, val = runs[lanes]
        assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(losses, ref_losses, strict=True)), (lanes, losses)
        assert abs(val - ref_val) <= 1e-6 * abs(ref_val)
