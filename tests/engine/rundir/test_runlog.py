import json
import os

import torch
from multilane.engine.rundir.runlog import RunDir, iter_metrics, read_metrics


def test_two_runs_started_in_the_same_second_get_two_folders(tmp_path):
    a = RunDir.create(tmp_path, "same")
    b = RunDir.create(tmp_path, "same")
    assert a.path != b.path and a.path.is_dir() and b.path.is_dir()


def test_a_torn_last_line_is_skipped_and_every_whole_line_parses(tmp_path):
    rd = RunDir.create(tmp_path, "r")
    for s in range(1, 4):
        rd.append_metric({"kind": "train", "step": s, "loss": 1.0 / s})
    rd.close()
    with open(rd.path / "metrics.jsonl", "ab") as f:
        f.write(b'{"kind":"train","step":4,"lo')  # what a kill in mid-write would leave
    assert [r["step"] for r in iter_metrics(rd.path / "metrics.jsonl")] == [1, 2, 3]


def test_nan_is_written_as_null_so_strict_readers_parse_it(tmp_path):
    rd = RunDir.create(tmp_path, "r")
    rd.append_metric({"kind": "train", "step": 1, "loss": float("nan"), "device_loss": {"cpu:0": float("inf")}})
    rd.close()
    line = (rd.path / "metrics.jsonl").read_text().strip()
    assert json.loads(line)["loss"] is None and "NaN" not in line


def test_records_after_the_checkpoint_are_superseded_on_resume(tmp_path):
    rd = RunDir.create(tmp_path, "r")
    for s in range(1, 6):
        rd.append_metric({"kind": "train", "step": s})
    rd.append_metric({"kind": "event", "event": "started", "step": 3, "resumed_from_step": 3})
    for s in range(4, 7):
        rd.append_metric({"kind": "train", "step": s})
    rd.close()
    assert [r["step"] for r in read_metrics(rd.path) if r["kind"] == "train"] == [1, 2, 3, 4, 5, 6]


def test_checkpoints_are_replaced_atomically_and_load_weights_only(tmp_path):
    rd = RunDir.create(tmp_path, "r")
    rd.save_checkpoint({"model": {"w": torch.ones(3)}, "step": 1})
    rd.save_checkpoint({"model": {"w": torch.zeros(3)}, "step": 2})
    ck = torch.load(rd.path / "checkpoints/last.pt", weights_only=True)
    assert ck["step"] == 2
    assert [p.name for p in (rd.path / "checkpoints").iterdir()] == ["last.pt"]  # no temporary left behind


def test_status_is_rewritten_whole(tmp_path):
    rd = RunDir.create(tmp_path, "r")
    rd.set_status("running", step=1)
    rd.set_status("finished", "done", step=2)
    assert json.loads((rd.path / "status.json").read_text())["state"] == "finished"
    assert not [n for n in os.listdir(rd.path) if n.endswith(".tmp")]
