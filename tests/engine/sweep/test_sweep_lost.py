"""Lost trials are lost, not failed: a trial whose process or worker died without an end is re-queued
and not counted, and its run folder says what happened. A trial being asked by a live worker of this
machine is never taken for lost (the ask and the worker's identity are written under one lock)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import CLI
from sweep_helpers import TINY, load_journal

pytestmark = pytest.mark.timeout(1800)


def _sweep(tmp_path, trials=3):
    from multilane.engine.sweep.space import parse_params
    from multilane.engine.sweep.spec import SweepSpec
    from multilane.engine.sweep.study import Sweep

    params = parse_params(["optim.lr=log:1e-4:1e-1"], "digits")
    return Sweep.create(SweepSpec(task="digits", params=params, trials=trials, name="lost"), tmp_path)


def test_a_running_trial_nobody_runs_is_lost_requeued_and_its_run_folder_says_so(tmp_path):
    import optuna
    from multilane.engine.sweep.recovery import recover_lost

    sweep = _sweep(tmp_path)
    run = tmp_path / "trial-run"
    run.mkdir()
    (run / "status.json").write_text(json.dumps({"state": "running", "step": 7}))
    trial = sweep.study.ask()  # asked with no worker's identity: its asker died before writing it
    trial.suggest_float("optim.lr", 1e-4, 1e-1, log=True)
    trial.set_user_attr("run_dir", str(run))
    lr = trial.params["optim.lr"]
    assert recover_lost(sweep) == [0]  # a journal: every worker is on this machine, no grace needed
    t0, t1 = load_journal(sweep.folder).trials
    assert t0.state == optuna.trial.TrialState.FAIL and t0.user_attrs["lost"]
    assert t1.state == optuna.trial.TrialState.WAITING and t1.system_attrs["fixed_params"] == {"optim.lr": lr}
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "aborted" and status["message"].startswith("lost:") and status["step"] == 7
    assert sweep.counts() == {"done": 0, "running": 0, "lost": 1, "waiting": 1}
    from multilane.engine.sweep.rows import trial_rows

    rows = trial_rows(load_journal(sweep.folder))  # what the Sweep tab's table and the CLI's show
    assert [(r["state"], r["params"]) for r in rows] == [("lost", {"optim.lr": lr}), ("waiting", {"optim.lr": lr})]


def test_in_a_shared_database_a_trial_without_identity_gets_a_grace_and_a_live_workers_trial_is_kept(tmp_path):
    from multilane.engine.sweep.recovery import recover_lost

    sweep = _sweep(tmp_path)
    sweep.study.ask()  # no identity yet: another machine's worker may be between its ask and its identity
    mine, _ = sweep.ask()  # this process: alive
    sweep.storage_url = "postgresql://db/x"  # judged as a shared database's study is
    assert recover_lost(sweep, grace_s=3600) == []
    assert recover_lost(sweep, grace_s=0) == [0]
    assert mine.number not in recover_lost(sweep, grace_s=0)


ASKER = """
import sys
from multilane.engine.sweep.study import Sweep
sweep = Sweep.open(sys.argv[1])
for _ in range(int(sys.argv[2])):
    trial, params = sweep.ask()
    sweep.study.tell(trial, 1.0)
"""
RECOVERER = """
import sys
from multilane.engine.sweep.study import Sweep
sweep = Sweep.open(sys.argv[1])
n = 0
while sys.stdin.readline() == "again\\n":
    n += len(sweep.recover_lost())
    print(n, flush=True)
"""


@pytest.mark.slow
def test_a_worker_recovering_never_takes_a_trial_another_worker_here_is_asking(tmp_path):
    # The race: study.ask() makes a trial RUNNING before its asker writes who runs it. Another worker on
    # this machine recovering lost trials in that window took it for lost, re-queued it, and both ran it.
    sweep = _sweep(tmp_path, trials=100)
    rec = subprocess.Popen([sys.executable, "-c", RECOVERER, str(sweep.folder)], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True)  # fmt: skip
    ask = subprocess.Popen([sys.executable, "-c", ASKER, str(sweep.folder), "60"])
    rounds, recovered = 0, "0"
    while ask.poll() is None:
        rec.stdin.write("again\n")
        rec.stdin.flush()
        recovered = rec.stdout.readline().strip()
        rounds += 1
    rec.stdin.write("stop\n")
    rec.communicate(timeout=60)
    assert ask.returncode == 0
    assert rounds > 20  # it really recovered while the other asked
    assert recovered == "0"
    trials = load_journal(sweep.folder).trials
    assert len(trials) == 60 and not any(t.user_attrs.get("lost") for t in trials)


@pytest.mark.slow
def test_a_trial_process_killed_mid_run_is_requeued_not_counted_and_its_folder_says_aborted(tmp_path):
    import optuna

    proc = subprocess.Popen(
        [*CLI, "sweep", *TINY, "--steps", "120", "--set", "train.eval_every=60", "--devices", "cpu:0", "--trials", "1", "--pruner", "none",
         "--param", "optim.lr=log:1e-3:1e-2", "--sweeps-dir", str(tmp_path), "--no-table"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        end = time.monotonic() + 600
        while True:
            run = next(tmp_path.glob("*/trial-0000"), None)
            if run and (run / "metrics.jsonl").exists() and '"kind":"train"' in (run / "metrics.jsonl").read_text():
                break
            assert time.monotonic() < end and proc.poll() is None
            time.sleep(0.2)
        pid = int((run / ".lock").read_text().split()[0])  # the trial's own process (its run folder's writer)
        os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    t0, t1 = load_journal(run.parent).trials
    assert t0.state == optuna.trial.TrialState.FAIL and "SIGKILL" in t0.user_attrs["lost"]
    assert t1.state == optuna.trial.TrialState.COMPLETE and t1.params == t0.params  # re-queued, then run
    assert "1 of 1 trials done" in out
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "aborted" and "SIGKILL" in status["message"]
