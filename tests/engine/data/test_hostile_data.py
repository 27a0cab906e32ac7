"""DataLoader workers that end, and image folders that hold FIFOs and symlink loops.
Real runs, real worker processes, real FIFOs and links."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import CLI
from multilane.engine.tasks.imagefolder import torchvision_or_hint

pytestmark = pytest.mark.timeout(300)

EXITING_WORKER = """
import os, signal, sys
import torch
from multilane.engine.tasks.builtin import LinearTask

class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        if i == 13:
            {how}
        g = torch.Generator().manual_seed(i)
        return torch.randn(10, generator=g), torch.randn(1, generator=g)

class Exits(LinearTask):
    name = "exits"

    def data(self):
        return Data()
"""

HOW = {
    "sys.exit": "sys.exit(3)",
    "SIGKILL": "os.kill(os.getpid(), signal.SIGKILL)",
    "os._exit": "os._exit(4)",
}


@pytest.mark.slow
@pytest.mark.parametrize("how", list(HOW), ids=list(HOW))
def test_a_dataloader_worker_that_ends_fails_the_run_in_one_line_naming_it(tmp_path, how):
    task = tmp_path / "exits.py"
    task.write_text(EXITING_WORKER.replace("{how}", HOW[how]))
    runs = tmp_path / "runs"
    args = [*CLI, "train", "--task", str(task), "--devices", "cpu:0", "--steps", "40", "--runs-dir", str(runs)]
    args += ["--set", "data.workers=2", "--set", "data.batch_size=8", "--set", "telemetry.enabled=false"]
    for _ in range(2):  # torch's SIGCHLD handler raised at a random point: twice is two chances
        out = subprocess.run(args, capture_output=True, text=True, timeout=240)
        assert out.returncode == 1, out.stderr
        assert "Traceback" not in out.stderr, out.stderr
        run = sorted(p for p in runs.iterdir() if not p.name.startswith("."))[-1]
        status = json.loads((run / "status.json").read_text())
        assert status["state"] == "failed", status
        message = status["message"]
        if how == "sys.exit":
            assert "training sample 13" in message and "sys.exit(3)" in message, message
            assert "worker process" in message, message
        else:
            code = "SIGKILL" if how == "SIGKILL" else "status 4"
            assert "DataLoader worker" in message and code in message, message
        assert "ConnectionResetError" not in message


# -- imagefolder --------------------------------------------------------------------------------------


def make_images(root: Path, per_class: int = 6) -> Path:
    from PIL import Image

    for k, name in enumerate(("red", "blue")):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            img = torch.full((8, 8, 3), 40, dtype=torch.uint8)
            img[..., 0 if k == 0 else 2] = 200
            Image.fromarray(img.numpy()).save(root / name / f"{i}.png")
    return root


def test_scanning_skips_fifos_and_never_follows_a_loop_or_a_link_out(tmp_path):
    from multilane.engine.tasks.imagefolder import scan_images

    root = make_images(tmp_path / "images")
    os.mkfifo(root / "red" / "x.png")
    (root / "red" / "loop").symlink_to("..")  # cat/loop -> ..: the whole folder again, for ever
    (root / "red" / "self").symlink_to(".")
    outside = make_images(tmp_path / "outside")
    (root / "blue" / "out").symlink_to(outside / "blue")
    (root / "blue" / "other-class.png").symlink_to(root / "red" / "0.png")
    (root / "blue" / "sub").mkdir()
    (root / "blue" / "sub" / "deep.png").write_bytes((root / "blue" / "0.png").read_bytes())
    samples, skipped = scan_images(root, {"blue": 0, "red": 1}, (".png",))
    paths = [Path(p) for p, _ in samples]
    assert len(samples) == 13  # 6 + 6 images, and blue/sub/deep.png
    assert sorted(c for _, c in samples) == [0] * 7 + [1] * 6
    assert all(p.resolve().is_relative_to(root.resolve()) for p in paths)
    assert len({p.resolve() for p in paths}) == len(paths)  # no image twice
    names = {Path(s).name for s in skipped}
    assert {"x.png", "loop", "self", "out", "other-class.png"} <= names


@pytest.mark.slow
def test_an_imagefolder_run_with_a_fifo_and_a_symlink_loop_trains_on_each_image_once(tmp_path):
    torchvision_or_hint()  # the [vision] extra; the test extra installs it
    root = make_images(tmp_path / "images", per_class=12)
    os.mkfifo(root / "red" / "x.png")  # used to block a worker for ever
    (root / "red" / "loop").symlink_to("..")  # used to turn 24 images into hundreds of samples
    runs = tmp_path / "runs"
    args = [*CLI, "train", "--task", "imagefolder", "--devices", "cpu:0", "--steps", "3", "--runs-dir", str(runs)]
    settings = {
        "task.params.root": str(root),
        "task.params.image_size": 8,
        "data.workers": 2,
        "data.batch_size": 4,
        "data.val_fraction": 0.25,
        "telemetry.enabled": False,
    }
    for key, value in settings.items():
        args += ["--set", f"{key}={value}"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    (run,) = [p for p in runs.iterdir() if not p.name.startswith(".")]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    started = next(r for r in records if r.get("event") == "started")
    assert started["total_steps"] == 3
    warnings = [r["message"] for r in records if r.get("event") == "warning"]
    assert any("2 entries skipped" in w for w in warnings), warnings
    config = json.loads((run / "config.json").read_text())
    assert config["task"]["params"]["root"] == str(root)
    # 24 images, a quarter held out: 18 to train on, not hundreds
    from multilane.engine.tasks import make_task

    task = make_task("imagefolder", {"root": str(root), "image_size": 8})
    assert len(task.data()) == 24
