"""Per-lane randomness and BatchNorm through the whole trainer, with a task file as a user writes one:
dropout under activation checkpointing reproduces and resumes bitwise on several lanes, and
``devices.sync_batchnorm`` trains a BatchNorm model as one device with the whole batch would."""

import textwrap

import pytest
import torch
from multilane.engine.run.control import RunControl
from multilane.engine.run.trainer import Trainer, TrainerCallback

TASK = textwrap.dedent(
    """
    import torch
    from pydantic import BaseModel
    from torch import nn
    from torch.nn import functional as F
    from torch.utils.checkpoint import checkpoint
    from multilane.engine.tasks import ArrayData, Task


    class Params(BaseModel):
        dropout: float = 0.25
        batchnorm: bool = True
        bn_in_checkpoint: bool = False


    class Net(nn.Module):
        def __init__(self, p, batchnorm, bn_in_checkpoint):
            super().__init__()
            self.inp = nn.Linear(5, 16)
            self.bn = nn.BatchNorm1d(16) if batchnorm and not bn_in_checkpoint else nn.Identity()
            inner = [nn.BatchNorm1d(16)] if bn_in_checkpoint else []
            self.block = nn.Sequential(*inner, nn.Tanh(), nn.Dropout(p), nn.Linear(16, 16), nn.Tanh())
            self.drop = nn.Dropout(p)
            self.out = nn.Linear(16, 1)

        def forward(self, x):
            h = self.bn(self.inp(x))
            return self.out(self.drop(checkpoint(self.block, h, use_reentrant=False)))


    class DropoutTask(Task):
        name = "dropout-bn"
        Params = Params

        def build_model(self):
            p = self.params
            return Net(p.dropout, p.batchnorm, p.bn_in_checkpoint).double()

        def data(self):
            g = torch.Generator().manual_seed(3)
            x = torch.randn(120, 5, generator=g, dtype=torch.float64) * 2 + 1
            return ArrayData(x, x.sum(dim=1, keepdim=True).sin())

        def loss(self, output, target):
            return F.mse_loss(output, target)
    """
)


@pytest.fixture
def task_file(tmp_path):
    path = tmp_path / "dropout_bn_task.py"
    path.write_text(TASK)
    return str(path)


class StopAt(TrainerCallback):
    def __init__(self, control, step):
        self.control, self.step = control, step

    def on_log(self, r):
        if r["step"] == self.step:
            self.control.request_stop()


def state(trainer):
    return {k: v.clone() for k, v in trainer.model.state_dict().items()}


def test_dropout_under_checkpointing_resumes_bitwise_on_three_lanes(make_config, task_file):
    cfg = make_config(
        task__name=task_file,
        devices__use="cpu:0,cpu:1,cpu:2",
        devices__weights=[1, 3, 2],
        train__steps=12,
        data__batch_size=17,
        train__eval_every=5,
    )
    straight = Trainer(cfg)
    assert straight.run().status == "finished"
    control = RunControl()
    stopped = Trainer(cfg.model_copy(deep=True), callbacks=[StopAt(control, 5)], control=control).run()
    assert stopped.status == "stopped"
    torch.manual_seed(999)  # whatever else the process draws in between
    resumed = Trainer(resume_from=stopped.run_dir)
    assert resumed.run().status == "finished"
    a, b = state(straight), state(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_seed_reproduces_a_multi_lane_dropout_run(make_config, task_file):
    def train(seed):
        cfg = make_config(
            task__name=task_file, devices__use="cpu:0,cpu:1", train__steps=6, train__seed=seed, data__batch_size=16
        )
        t = Trainer(cfg)
        t.run()
        return state(t)

    a, b, c = train(4), train(4), train(5)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["out.weight"], c["out.weight"])


@pytest.mark.parametrize(("devices", "weights"), [("cpu:0,cpu:1", []), ("cpu:0,cpu:1,cpu:2", [3, 1, 2])])
def test_sync_batchnorm_trains_like_one_device_with_the_whole_batch(make_config, task_file, devices, weights):
    def train(devices, weights, sync):
        cfg = make_config(
            task__name=task_file,
            task__params={"dropout": 0.0},
            devices__use=devices,
            devices__weights=weights,
            devices__sync_batchnorm=sync,
            train__steps=6,
            data__batch_size=23,
            optim__name="sgd",
            optim__lr=0.05,
        )
        t = Trainer(cfg)
        assert t.run().status == "finished"
        return state(t)

    one = train("cpu:0", [], sync=False)
    got = train(devices, weights, sync=True)
    for k in one:
        scale = one[k].abs().max().clamp_min(1e-300)
        assert ((got[k] - one[k]).abs().max() / scale).item() < 1e-10, k


def test_running_stats_keep_updating_when_the_first_lane_gets_nothing(make_config, task_file):
    cfg = make_config(
        task__name=task_file,
        task__params={"dropout": 0.0},
        devices__weights=[0, 1],
        train__steps=4,
        data__batch_size=16,
    )
    t = Trainer(cfg)
    t.run()
    assert t.model.bn.num_batches_tracked.item() == 4
    assert t.model.bn.running_mean.abs().min().item() > 0


def test_sync_batchnorm_inside_checkpointing_fails_the_first_step_with_one_line(make_config, task_file):
    cfg = make_config(
        task__name=task_file,
        task__params={"bn_in_checkpoint": True},
        devices__sync_batchnorm=True,
        train__steps=3,
        data__batch_size=16,
    )
    result = Trainer(cfg).run()
    assert result.status == "failed"
    assert "step 1" in result.message and "torch.utils.checkpoint" in result.message
    assert "\n" not in result.message
