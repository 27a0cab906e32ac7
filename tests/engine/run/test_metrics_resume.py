"""A run's metrics survive stop and resume: the resumed run's metrics.jsonl tells the straight run's story."""

import pytest
from helpers import TESTS
from multilane.engine.run.control import RunControl
from multilane.engine.run.trainer import Trainer, TrainerCallback
from multilane.engine.rundir.runlog import read_metrics

SAME = ("step", "loss", "device_loss", "lr", "epoch", "grad_norm")


class StopAtStep(RunControl, TrainerCallback):
    """Asks the trainer to stop once it has finished ``at`` steps (a user pressing Stop then)."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at
        self.trainer: Trainer | None = None

    def on_train_start(self, trainer: Trainer) -> None:
        self.trainer = trainer

    @property
    def stop_requested(self) -> bool:
        return super().stop_requested or (self.trainer is not None and self.trainer.step >= self.at)


def story(run_dir):
    recs = read_metrics(run_dir)
    train = [{k: r.get(k) for k in SAME} for r in recs if r["kind"] == "train"]
    evals = [(r["step"], r["val_loss"], r["metrics"]) for r in recs if r["kind"] == "eval"]
    return train, evals


@pytest.mark.parametrize(("log_every", "stop_at"), [(7, 52), (7, 49), (5, 3), (1, 20)])
def test_stop_then_resume_logs_what_a_straight_run_logs(make_config, log_every, stop_at):
    cfg = dict(
        task__name="linear",
        task__params={"samples": 400},
        data__batch_size=16,
        train__steps=60,
        train__log_every=log_every,
        train__eval_every=10,
        train__grad_clip=1.0,
        devices__use="cpu:0,cpu:1",
        devices__weights=[2, 1],
    )
    straight = Trainer(make_config(**cfg, run__name="straight")).run()
    assert straight.status == "finished"

    stopper = StopAtStep(stop_at)
    first = Trainer(make_config(**cfg, run__name="stopped"), callbacks=[stopper], control=stopper).run()
    assert first.status == "stopped" and first.step == stop_at
    if stop_at % log_every:
        # The stop logged its open window, marked partial, so no step's loss is lost on a plain stop.
        partial = [r for r in read_metrics(first.run_dir) if r.get("partial")]
        assert [r["step"] for r in partial] == [stop_at]

    resumed = Trainer(resume_from=first.run_dir).run()
    assert resumed.status == "finished" and resumed.step == 60
    assert story(resumed.run_dir) == story(straight.run_dir)


def test_telemetry_records_carry_the_step(make_config):
    result = Trainer(
        make_config(
            task__name="linear", train__steps=400, train__log_every=50, telemetry__rate_hz=50, telemetry__record_s=0.1
        )
    ).run()
    tele = [r for r in read_metrics(result.run_dir) if r["kind"] == "telemetry"]
    assert tele and all(isinstance(r["step"], int) and 0 <= r["step"] <= 400 for r in tele)


def test_a_failure_in_the_final_evaluation_names_the_last_step(make_config, tmp_path):
    task = tmp_path / "bad_metrics.py"
    here = str(TESTS)
    task.write_text(
        f"import sys\nsys.path.insert(0, {here!r})\n"
        "from helpers import Float64Task\n"
        "class BadMetrics(Float64Task):\n"
        "    name = 'bad-metrics'\n"
        "    def metrics(self, output, target):\n"
        "        raise RuntimeError('metric exploded')\n"
    )
    result = Trainer(make_config(task__name=str(task), train__steps=30, train__eval_every=0)).run()
    assert result.status == "failed" and result.step == 30
    assert "step 30:" in result.message and "metric exploded" in result.message
