"""Numbers a user reads must not mislead: throughput across a pause, the failed step, the CLI's summary."""

import statistics
import threading
import time

from helpers import Float64Task
from multilane.engine.run.control import RunControl
from multilane.engine.run.trainer import Trainer, TrainerCallback

STEP_S = 0.02  # each step sleeps this long in its loss: the rate is known whatever else the CPU does


class SlowTask(Float64Task):
    """Float64Task whose loss sleeps STEP_S and pauses the run, mid log window, at one chosen call."""

    def __init__(self, control: RunControl, pause_at: int, pause_s: float) -> None:
        super().__init__()
        self.control, self.pause_at, self.pause_s, self.calls = control, pause_at, pause_s, 0

    def loss(self, output, target):
        self.calls += 1
        if self.calls == self.pause_at:
            self.control.pause()  # taken between steps, after this one
            threading.Timer(self.pause_s, self.control.resume).start()
        time.sleep(STEP_S)
        return super().loss(output, target)


class Logs(TrainerCallback):
    def __init__(self):
        self.logs = []

    def on_log(self, r):
        self.logs.append(r)


def test_throughput_across_a_pause_counts_only_running_time(make_config):
    # One lane, log every 10 steps, a 1.5 s pause after step 15: the window of steps 11-20 holds
    # ten steps' samples. Counting them over the five steps after the resume (the old bug) gave 2x.
    control = RunControl()
    logs = Logs()
    cfg = make_config(devices__use="cpu:0", train__steps=40, train__log_every=10, data__batch_size=8)
    task = SlowTask(control, pause_at=15, pause_s=1.5)
    result = Trainer(cfg, callbacks=[logs], control=control, task=task).run()
    assert result.status == "finished", result.message
    rates = {r["step"]: r["samples_per_s"] for r in logs.logs}
    assert sorted(rates) == [10, 20, 30, 40]
    others = statistics.median(rates[s] for s in (10, 30, 40))
    assert rates[20] < 8 / STEP_S * 1.05, rates  # never faster than the sleep allows
    assert 0.7 < rates[20] / others < 1.3, rates  # neither inflated (2x) nor deflated by the pause (0.4x)
