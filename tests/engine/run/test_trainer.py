"""The trainer as a user meets it: budgets, evaluation, schedules, callbacks, pause/stop/resume."""

import math
import threading
import time

import pytest
import torch
from helpers import Float64Task, max_rel_diff
from multilane.engine.config import ScheduleSection
from multilane.engine.run.control import RunControl
from multilane.engine.run.trainer import Trainer, TrainerCallback
from multilane.engine.rundir.runlog import read_metrics
from multilane.engine.tasks import make_task
from multilane.engine.tensors.optim import lr_at


class Recorder(TrainerCallback):
    def __init__(self):
        self.logs, self.evals, self.events = [], [], []

    def on_log(self, r):
        self.logs.append(r)

    def on_eval(self, r):
        self.evals.append(r)

    def on_event(self, r):
        self.events.append(r["event"])


def run(config, **kw):
    rec = Recorder()
    trainer = Trainer(config, callbacks=[rec], **kw)
    return trainer, trainer.run(), rec


def test_a_step_budget_runs_exactly_that_many_steps(make_config):
    _trainer, result, rec = run(make_config(task__name="linear", train__steps=7))
    assert result.status == "finished" and result.step == 7
    assert [r["step"] for r in rec.logs] == list(range(1, 8))
    assert rec.events == ["started", "finished"]


def test_epochs_cover_the_training_set(make_config):
    cfg = make_config(
        task__name="linear",
        task__params={"samples": 100},
        data__batch_size=16,
        train__epochs=3,
        data__val_fraction=0.2,
    )
    trainer, result, _ = run(cfg)
    assert trainer.total_steps == 3 * math.ceil(80 / 16)
    assert result.step == trainer.total_steps


def test_train_records_carry_every_metric_the_app_plots(make_config):
    _, _result, rec = run(make_config(task__name="linear", train__steps=4, train__log_every=2, train__grad_clip=1.0))
    r = rec.logs[-1]
    assert set(r["device_loss"]) == {"cpu:0", "cpu:1"}
    assert set(r["phase_ms"]) == {
        "data",
        "scatter",
        "replicate",
        "forward",
        "loss",
        "backward",
        "reduce",
        "optimizer",
    }
    assert r["phase_ms"]["forward"] > 0 and r["samples_per_s"] > 0
    assert r["grad_norm"] > 0 and r["lr"] == pytest.approx(3e-3)
    assert all(v > 0 for v in r["lane_busy_s"].values())


def test_the_logged_loss_is_the_mean_of_the_window(make_config):
    _, _, every = run(make_config(task__name="linear", train__steps=6, train__log_every=1))
    _, _, window = run(make_config(task__name="linear", train__steps=6, train__log_every=3))
    assert window.logs[0]["loss"] == pytest.approx(sum(r["loss"] for r in every.logs[:3]) / 3, rel=1e-6)
    for lane in ("cpu:0", "cpu:1"):
        expect = sum(r["device_loss"][lane] for r in every.logs[3:]) / 3
        assert window.logs[1]["device_loss"][lane] == pytest.approx(expect, rel=1e-6)


def test_evaluation_reports_validation_loss_and_the_task_metric(make_config):
    _, result, rec = run(make_config(task__name="digits", train__steps=20, train__eval_every=10))
    assert [r["step"] for r in rec.evals] == [10, 20]
    assert 0.0 <= rec.evals[-1]["metrics"]["accuracy"] <= 1.0
    assert result.last_eval["val_loss"] < rec.evals[0]["val_loss"] * 1.5


def test_the_same_seed_reproduces_a_cpu_run_exactly(make_config):
    a, _, _ = run(make_config(task__name="mlp", task__params={"samples": 512}, train__steps=10, train__seed=5))
    b, _, _ = run(make_config(task__name="mlp", task__params={"samples": 512}, train__steps=10, train__seed=5))
    c, _, _ = run(make_config(task__name="mlp", task__params={"samples": 512}, train__steps=10, train__seed=6))
    assert max_rel_diff(a.model, b.model) == 0.0
    assert max_rel_diff(a.model, c.model) > 0.0


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adamw"])
def test_lanes_match_one_lane_through_the_whole_trainer(make_config, optimizer):
    def train(devices):
        cfg = make_config(
            devices__use=devices,
            train__steps=8,
            optim__name=optimizer,
            optim__lr=0.01,
            data__batch_size=13,
            optim__nesterov=optimizer == "sgd",
        )
        trainer = Trainer(cfg, task=Float64Task())
        trainer.run()
        return trainer.model

    one = train("cpu:0")
    assert max_rel_diff(train("cpu:0,cpu:1,cpu:2"), one) < 1e-10


def test_gradient_accumulation_equals_the_bigger_batch(make_config):
    def train(batch, accum):
        cfg = make_config(
            devices__use="cpu:0,cpu:1",
            train__steps=5,
            data__batch_size=batch,
            train__grad_accum=accum,
            data__val_fraction=0.25,
            optim__name="sgd",
            optim__lr=0.05,
        )
        trainer = Trainer(cfg, task=Float64Task(Float64Task.Params(samples=128)))
        trainer.run()
        return trainer.model

    assert max_rel_diff(train(8, 4), train(32, 1)) < 1e-10


def test_schedules():
    cos = ScheduleSection(kind="cosine", warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, 110, 1.0, cos) == pytest.approx(0.1)
    assert lr_at(9, 110, 1.0, cos) == pytest.approx(1.0)
    assert lr_at(60, 110, 1.0, cos) == pytest.approx(0.55)
    assert lr_at(110, 110, 1.0, cos) == pytest.approx(0.1)
    step = ScheduleSection(kind="step", step_size=10, gamma=0.5)
    assert [lr_at(s, 100, 1.0, step) for s in (0, 9, 10, 25)] == [1.0, 1.0, 0.5, 0.25]
    assert lr_at(50, 100, 0.3, ScheduleSection()) == 0.3


def test_the_scheduled_lr_reaches_the_optimizer(make_config):
    _, _, rec = run(
        make_config(
            task__name="linear",
            train__steps=4,
            schedule__kind="step",
            schedule__step_size=2,
            schedule__gamma=0.1,
            optim__lr=1.0,
        )
    )
    assert [r["lr"] for r in rec.logs] == pytest.approx([1.0, 1.0, 0.1, 0.1])


class StopAt(TrainerCallback):
    def __init__(self, control, step):
        self.control, self.step = control, step

    def on_log(self, r):
        if r["step"] == self.step:
            self.control.request_stop()


def test_stop_mid_run_finishes_the_step_and_saves_a_checkpoint(make_config):
    control = RunControl()
    cfg = make_config(task__name="linear", train__steps=50)
    trainer = Trainer(cfg, callbacks=[StopAt(control, 12)], control=control)
    result = trainer.run()
    assert result.status == "stopped" and result.step == 12
    ck = torch.load(result.run_dir / "checkpoints/last.pt", weights_only=True)
    assert ck["step"] == 12
    assert [r["step"] for r in read_metrics(result.run_dir) if r["kind"] == "train"] == list(range(1, 13))


def test_stop_then_resume_ends_with_the_same_parameters_bitwise(make_config):
    cfg = make_config(task__name="digits", train__steps=30, data__batch_size=32, train__eval_every=10)
    straight = Trainer(cfg)
    straight.run()
    control = RunControl()
    first = Trainer(cfg, callbacks=[StopAt(control, 13)], control=control)
    stopped = first.run()
    assert stopped.status == "stopped"
    resumed = Trainer(resume_from=stopped.run_dir)
    result = resumed.run()
    assert result.status == "finished" and result.step == 30
    for p, q in zip(resumed.model.parameters(), straight.model.parameters(), strict=True):
        assert torch.equal(p, q)
    steps = [r["step"] for r in read_metrics(result.run_dir) if r["kind"] == "train"]
    assert steps == list(range(1, 31))


def test_resume_can_extend_the_step_budget(make_config):
    first = Trainer(make_config(task__name="linear", train__steps=5)).run()
    second = Trainer(resume_from=first.run_dir, overrides={"train.steps": 8})
    result = second.run()
    assert result.step == 8 and second.total_steps == 8


def test_pause_and_resume_from_another_thread(make_config):
    control = RunControl()
    paused = threading.Event()

    class PauseOnce(TrainerCallback):
        def on_log(self, r):
            if r["step"] == 3:
                control.pause()

        def on_event(self, r):
            if r["event"] == "paused":
                paused.set()

    rec = Recorder()
    trainer = Trainer(make_config(task__name="linear", train__steps=6), callbacks=[PauseOnce(), rec], control=control)
    t = threading.Thread(target=trainer.run, daemon=True)
    t.start()
    try:
        assert paused.wait(30)
        status = (trainer.run_dir.path / "status.json").read_text()
        assert '"paused"' in status
        control.resume()
        t.join(30)
    finally:
        control.request_stop()
    assert rec.events == ["started", "paused", "resumed", "finished"]
    assert [r["step"] for r in rec.logs] == list(range(1, 7))


class HoldAtStep3(TrainerCallback):
    """Takes a hold from inside the run, right after step 3 is logged (no race with the test thread)."""

    def __init__(self, control, seconds):
        self.control, self.seconds = control, seconds

    def on_log(self, r):
        if r["step"] == 3:
            self.control.hold(self.seconds)


def test_a_hold_keeps_the_next_step_waiting_until_it_is_released(make_config):
    control = RunControl()
    rec = Recorder()
    trainer = Trainer(
        make_config(task__name="linear", train__steps=6), callbacks=[HoldAtStep3(control, 60), rec], control=control
    )
    t = threading.Thread(target=trainer.run, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 30
        while not rec.logs or rec.logs[-1]["step"] < 3:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert control.wait_until_held(10)  # the trainer reached the hold and waits on it
        time.sleep(0.4)
        assert rec.logs[-1]["step"] == 3  # held: step 4 has not run
        control.release()
        t.join(30)
    finally:
        control.request_stop()
    assert [r["step"] for r in rec.logs] == list(range(1, 7))
    assert control.held_s >= 0.35
    assert rec.events == ["started", "finished"]  # a hold is not a pause: nothing is logged for it


def test_a_hold_nobody_releases_ends_by_itself(make_config):
    control = RunControl()
    rec = Recorder()
    trainer = Trainer(
        make_config(task__name="linear", train__steps=6), callbacks=[HoldAtStep3(control, 0.3), rec], control=control
    )
    result = trainer.run()
    assert result.status == "finished"
    assert [r["step"] for r in rec.logs] == list(range(1, 7))
    assert 0.25 <= control.held_s < 5
    assert not control.wait_until_held(0.01)  # nobody waits on a hold now


def test_a_failing_replica_ends_the_run_failed_and_keeps_the_metrics(make_config, tmp_path):
    task_file = tmp_path / "boom.py"
    task_file.write_text(
        "import torch\n"
        "from multilane.engine.tasks.builtin import LinearTask\n"
        "class Boom(LinearTask):\n"
        "    name = 'boom'\n"
        "    def build_model(self):\n"
        "        lin = torch.nn.Linear(10, 1)\n"
        "        calls = [0]\n"
        "        def hook(module, args):\n"
        "            calls[0] += 1\n"
        "            if calls[0] > 8 and args[0].abs().max() < 1e9:\n"
        "                raise RuntimeError('exploded in forward')\n"
        "        lin.register_forward_pre_hook(hook)\n"
        "        return lin\n"
    )
    rec = Recorder()
    result = Trainer(make_config(task__name=str(task_file), train__steps=20), callbacks=[rec]).run()
    assert result.status == "failed"
    assert "Caught RuntimeError in replica" in result.message and "on device cpu:" in result.message
    assert "exploded in forward" in result.message
    assert (result.run_dir / "error.txt").read_text().count("exploded in forward") >= 1
    assert len([r for r in read_metrics(result.run_dir) if r["kind"] == "train"]) == len(rec.logs) >= 4
    assert rec.events[-1] == "failed"


def test_a_nonfinite_loss_stops_naming_the_step_and_device(make_config):
    cfg = make_config(
        task__name="linear",
        train__steps=40,
        optim__name="sgd",
        optim__lr=10.0,
        optim__momentum=0.9,
        train__checkpoint_every=1,
    )
    result = Trainer(cfg).run()
    assert result.status == "diverged"
    assert "loss became" in result.message and "at step" in result.message and "cpu:" in result.message
    ck = torch.load(result.run_dir / "checkpoints/last.pt", weights_only=True)
    assert ck["step"] < result.step
    assert all(torch.isfinite(v).all() for v in ck["model"].values())


def test_bf16_on_cpu_lanes_trains(make_config):
    _, result, rec = run(make_config(task__name="digits", train__steps=5, train__precision="bf16"))
    assert result.status == "finished" and math.isfinite(rec.logs[-1]["loss"])


def test_builtin_tasks_build_and_learn(make_config):
    for name in ("linear", "mlp"):
        _, _result, rec = run(make_config(task__name=name, train__steps=30, train__eval_every=30))
        assert rec.logs[-1]["loss"] < rec.logs[0]["loss"], name
    assert make_task("digits").build_model()(torch.zeros(2, 1, 8, 8)).shape == (2, 10)


@pytest.mark.parametrize(("devices", "strategy"), [("cpu:0", "replicate"), ("cpu:0,cpu:1,cpu:2", "persistent")])
def test_the_gradient_norm_is_logged_without_clipping_equal_to_a_plain_loop(make_config, devices, strategy):
    # not clipping: the total gradient norm of each log window's last step (clipping: the window's mean)
    task = Float64Task()
    cfg = make_config(
        devices__use=devices, devices__strategy=strategy, train__steps=4, train__log_every=2, data__batch_size=24
    )
    cfg = cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"name": "sgd", "momentum": 0.0})})
    ref = Trainer(cfg, task=Float64Task())
    ref._setup()
    ref.backend.close()
    model, norms = ref.model, []
    opt = torch.optim.SGD(model.parameters(), lr=cfg.optim.lr)
    for m in range(cfg.train.steps):
        x, y, _ = ref.loader.batches.get(m)
        opt.zero_grad()
        task.loss(model(x), y).backward()
        norms.append(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item())
        opt.step()
    _, result, rec = run(cfg, task=task)
    assert result.status == "finished", result.message
    got = [r["grad_norm"] for r in rec.logs]
    assert got == pytest.approx([norms[1], norms[3]], rel=1e-9)
