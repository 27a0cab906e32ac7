"""Numbers a user reads must not mislead: throughput across a pause, the failed step, the CLI's summary."""

import statistics
import threading
import time

import pytest
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


class TinyLossTask(Float64Task):
    """A loss of about 1e-7 (a well-fitted regression in small units): four decimals print 0.0000."""

    def loss(self, output, target):
        return 1e-7 * super().loss(output, target)

    def metrics(self, output, target):
        return {"mae": 1e-6 * (output - target).abs().mean()}


def test_small_losses_print_by_their_size_in_the_summary_watch_and_runs_table(make_config):
    from multilane.engine.cli.watch import WatchState
    from multilane.engine.display.progress import summary
    from multilane.engine.numbers import format_number
    from multilane.engine.rundir.runlog import read_metrics

    cfg = make_config(devices__use="cpu:0,cpu:1", train__steps=6, train__log_every=2, train__eval_every=3)
    result = Trainer(cfg, task=TinyLossTask()).run()
    assert result.status == "finished", result.message
    loss = result.last_train["loss"]
    assert 1e-9 < loss < 1e-5
    text = summary(result, 6)
    assert "0.0000" not in text and format_number(loss) in text and "e-0" in text  # scientific, not zero
    state = WatchState()
    for rec in read_metrics(result.run_dir):
        state.add(rec)
    line = state.line()
    assert "0.0000" not in line and f"loss {format_number(loss)}" in line and "val " in line
    # the app's runs table: the same numbers, the same way
    pytest.importorskip("PySide6")
    from multilane.gui.table.cells import run_cell
    from multilane.gui.table.runs_index import list_runs

    (row,) = list_runs(result.run_dir.parent)
    assert run_cell(row, "final_loss").text() == format_number(loss)
    assert "e-" in run_cell(row, "best_val_loss").text()


def test_format_number_reads_every_size():
    from multilane.engine.numbers import format_number

    assert format_number(2.302585) == "2.3026"
    assert format_number(6.1234e-7) == "6.12e-07"
    assert format_number(-3e-5) == "-3.00e-05"
    assert format_number(0.0) == "0.0000"
    assert format_number(0.05) == "0.0500"
    assert format_number(1.5e8) == "1.50e+08"
    assert format_number(float("nan")) == "nan" and format_number(float("-inf")) == "-inf"
    assert format_number(None) == "—"
