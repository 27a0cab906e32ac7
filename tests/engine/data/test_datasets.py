"""A task's own torch Dataset: the DataLoader path against the in-memory path, resume, workers, failures."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
import torch
from helpers import Float64Task
from multilane.engine.config import build_config
from multilane.engine.data.loader import ArrayLoader, DatasetLoader, build_loader
from multilane.engine.data.order import epoch_order, split_indices
from multilane.engine.display.progress import data_wait
from multilane.engine.errors import UserError
from multilane.engine.run.control import RunControl
from multilane.engine.run.trainer import Trainer, TrainerCallback
from multilane.engine.rundir.runlog import read_metrics
from torch.utils.data import Dataset, IterableDataset


class TensorPairs(Dataset):
    """Item i of an ArrayData, read one sample at a time (what a user's Dataset does); optionally logs
    every index it reads to a file (appends, so worker processes can log too) and fails on one index."""

    def __init__(self, inputs, target, log=None, fail_at=None, noise=False):
        self.inputs, self.target, self.log, self.fail_at, self.noise = inputs, target, log, fail_at, noise

    def __len__(self):
        return len(self.target)

    def __getitem__(self, i):
        if self.log is not None:
            with open(self.log, "a") as f:
                f.write(f"{i}\n")
        if i == self.fail_at:
            raise ValueError("corrupt record")
        x = self.inputs[i]
        if self.noise:  # a random augmentation from all three generators a transform may use
            x = x + torch.rand(()) + random.random() + float(np.random.rand())
        return x, self.target[i]


class Float64Dataset(Float64Task):
    name = "float64ds"

    def __init__(self, params=None, **kw):
        super().__init__(params)
        self.kw = kw

    def data(self):
        d = super().data()
        return TensorPairs(d.inputs, d.target, **self.kw)


def config(tmp_path, lanes=2, **over):
    base = {
        "run": {"runs_dir": str(tmp_path / "runs"), "name": "t"},
        "devices": {"use": ",".join(f"cpu:{i}" for i in range(lanes))},
        "data": {"batch_size": 20, "workers": 0},
        "train": {"steps": 12, "log_every": 1, "eval_every": 0},
        "telemetry": {"enabled": False},
    }
    for key, value in over.items():
        section, name = key.split("__")
        base.setdefault(section, {})[name] = value
    return build_config(base)


def reads(path):
    return [int(x) for x in path.read_text().split()] if path.exists() else []


class StopAt(TrainerCallback):
    def __init__(self, control, step):
        self.control, self.step = control, step

    def on_log(self, r):
        if r["step"] == self.step:
            self.control.request_stop()


@pytest.mark.parametrize("lanes", [1, 2, 3])
def test_a_dataset_task_trains_exactly_as_the_same_data_in_memory(tmp_path, lanes):
    cfg = config(tmp_path, lanes, train__eval_every=6)
    mem = Trainer(cfg, task=Float64Task())
    ds = Trainer(cfg, task=Float64Dataset())
    r1, r2 = mem.run(), ds.run()
    assert r1.status == r2.status == "finished"
    assert isinstance(mem.loader, ArrayLoader) and isinstance(ds.loader, DatasetLoader)
    for p, q in zip(ds.model.parameters(), mem.model.parameters(), strict=True):
        assert p.dtype == torch.float64
        assert (p - q).abs().max().item() <= 1e-10
    assert abs(r1.last_eval["val_loss"] - r2.last_eval["val_loss"]) <= 1e-10


def test_workers_0_and_2_give_identical_batches_even_with_random_augmentation(tmp_path):
    task = Float64Dataset(noise=True)
    cfg0 = config(tmp_path, data__workers=0)
    cfg2 = config(tmp_path, data__workers=2)
    a, b = build_loader(task, cfg0, None), build_loader(task, cfg2, None)
    a.start(5, 17)
    b.start(5, 17)
    try:
        for _ in range(12):
            torch.manual_seed(123)
            before = torch.get_rng_state()
            xa, ya, na = a.next()
            # Reading in the training process leaves the run's own generators as they were.
            assert torch.equal(torch.get_rng_state(), before)
            xb, yb, nb = b.next()
            assert na == nb and torch.equal(xa, xb) and torch.equal(ya, yb)
        val_a, val_b = list(a.eval_batches()), list(b.eval_batches())
        assert len(val_a) == len(val_b) > 0
        assert all(torch.equal(x[0], y[0]) for x, y in zip(val_a, val_b, strict=True))
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resumed_run_reads_exactly_the_samples_the_straight_run_reads_next(tmp_path, workers):
    over = {"data__workers": workers, "data__val_fraction": 0.0, "data__batch_size": 16, "train__steps": 14}
    straight_log, first_log, resumed_log = tmp_path / "straight", tmp_path / "first", tmp_path / "resumed"
    straight = Trainer(config(tmp_path, **over), task=Float64Dataset(log=straight_log))
    straight.run()
    # 96 samples in batches of 16: 6 micro-batches an epoch; stopping after step 8 is mid-epoch 1.
    control = RunControl()
    first = Trainer(
        config(tmp_path, **over), callbacks=[StopAt(control, 8)], control=control, task=Float64Dataset(log=first_log)
    )
    stopped = first.run()
    assert stopped.status == "stopped" and stopped.step == 8
    resumed = Trainer(resume_from=stopped.run_dir, task=Float64Dataset(log=resumed_log))
    assert resumed.run().status == "finished"
    got = reads(resumed_log)
    if workers == 0:
        assert got == reads(straight_log)[8 * 16 :]  # the same samples in the same order, none read twice
    else:
        # Two workers append to the log at once, sample by sample, so the straight log's first 128 lines
        # in file order are not the first 8 batches (which one lands first is the machine's timing). The
        # first 8 batches are those of one process (the batches do not depend on the worker count).
        first_8 = tmp_path / "first-8-in-one-process"
        Trainer(
            config(tmp_path, **{**over, "data__workers": 0, "train__steps": 8}), task=Float64Dataset(log=first_8)
        ).run()
        expected = Counter(reads(straight_log)) - Counter(reads(first_8))
        assert Counter(got) == expected  # workers read ahead in any order; nothing skipped is re-read
    assert len(got) == 6 * 16
    for p, q in zip(resumed.model.parameters(), straight.model.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_failing_getitem_fails_the_run_naming_the_sample_and_keeps_its_checkpoint(tmp_path, workers):
    n_train, bs = 96, 16
    train_idx, _ = split_indices(n_train, 0.0, 0)  # the split shuffles even with nothing held out
    bad = int(train_idx[epoch_order(n_train, 0, 0)[5 * bs + 3]])  # read by micro-batch 5, i.e. step 6
    cfg = config(
        tmp_path, data__workers=workers, data__val_fraction=0.0, data__batch_size=bs, train__checkpoint_every=2
    )
    trainer = Trainer(cfg, task=Float64Dataset(fail_at=bad))
    result = trainer.run()
    assert result.status == "failed" and result.step == 5
    assert "task float64ds, step 6" in result.message
    assert f"reading training sample {bad} failed: ValueError: corrupt record" in result.message
    if workers:
        assert "DataLoader worker process" in result.message
    assert "\n" not in result.message
    assert "corrupt record" in (result.run_dir / "error.txt").read_text()
    ck = torch.load(result.run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert ck["step"] == 4
    events = [r for r in read_metrics(result.run_dir) if r["kind"] == "event"]
    assert events[-1]["event"] == "failed"


class Stream(IterableDataset):
    def __init__(self, inputs, target):
        self.inputs, self.target = inputs, target

    def __iter__(self):
        yield from zip(self.inputs, self.target, strict=True)


class StreamTask(Float64Task):
    name = "stream"

    def data(self):
        d = super().data()
        return Stream(d.inputs[:80], d.target[:80]), Stream(d.inputs[80:], d.target[80:])


def test_an_iterable_dataset_trains_in_passes_and_resumes_by_replaying(tmp_path):
    cfg = config(tmp_path, train__steps=11, data__batch_size=16, train__eval_every=5)
    straight = Trainer(cfg, task=StreamTask())
    result = straight.run()
    assert result.status == "finished" and "val_loss" in result.last_eval
    assert straight.loader.passes == 2  # 5 micro-batches a pass: 11 steps start a second and a third
    control = RunControl()
    stopped = Trainer(cfg, callbacks=[StopAt(control, 7)], control=control, task=StreamTask()).run()
    resumed = Trainer(resume_from=stopped.run_dir, task=StreamTask())
    assert resumed.run().status == "finished"
    for p, q in zip(resumed.model.parameters(), straight.model.parameters(), strict=True):
        assert torch.equal(p, q)
    with pytest.raises(UserError, match=r"set train\.steps"):
        Trainer(config(tmp_path, train__steps=None), task=StreamTask()).run()


class Weird(Float64Task):
    name = "weird"

    def data(self):
        return {"x": 1}


class BadCollate(Float64Dataset):
    name = "badcollate"

    def collate(self, samples):
        return [torch.stack([s[0] for s in samples])]


def test_data_that_is_no_dataset_is_one_line_and_a_bad_collate_fails_the_run_clearly(tmp_path):
    with pytest.raises(UserError, match=r"task weird: data\(\) is a dict; data\(\) returns ArrayData, a torch Dataset"):
        Trainer(config(tmp_path), task=Weird()).run()
    result = Trainer(config(tmp_path), task=BadCollate()).run()
    assert result.status == "failed"
    assert "a training batch must be a pair (inputs, target)" in result.message and "got a list of 1" in result.message


def test_the_wait_for_data_is_logged_and_shown(tmp_path):
    import time

    class Slow(TensorPairs):
        def __getitem__(self, i):
            time.sleep(0.002)
            return super().__getitem__(i)

    class SlowTask(Float64Task):
        name = "slow"

        def data(self):
            d = super().data()
            return Slow(d.inputs, d.target)

    # 77 training samples: steps 1-3 read 20 each (step 4 would read the epoch's last 17)
    result = Trainer(config(tmp_path, lanes=1, train__steps=3), task=SlowTask()).run()
    rec = result.last_train
    assert rec["phase_ms"]["data"] >= 20 * 2.0 * 0.9  # 20 samples of 2 ms each per step
    assert rec["phase_ms"]["data"] <= rec["step_ms"]
    assert data_wait(rec).startswith(" · waiting on data ")
    assert data_wait({"phase_ms": {"data": 0.01}, "step_ms": 10.0}) == ""
