"""A sweep killed with kill -9: finished trials are kept, the trial whose process is gone is recorded
failed (never left running) and its parameters re-queued, and --resume reaches the asked count."""

import json
import os
import signal
import subprocess
import time

import pytest
from helpers import CLI
from sweep_helpers import TINY, load_journal, sweep_cli, sweep_folder

pytestmark = pytest.mark.timeout(1800)


def _wait(what, timeout=600.0):  # generous: a loaded machine starts a trial slowly
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = what()
        if got:
            return got
        time.sleep(0.3)
    raise AssertionError("timed out")


@pytest.mark.slow
def test_kill_9_mid_sweep_then_resume_reaches_the_count_with_no_trial_left_running(tmp_path):
    import optuna

    ts = optuna.trial.TrialState
    # One slot, 200-step trials: trial 0 finishes, trial 1 is mid-run when the sweep is killed.
    args = [*TINY, "--steps", "200", "--devices", "cpu:0", "--trials", "3", "--seed", "1"]
    proc = subprocess.Popen(
        [*CLI, "sweep", *args, "--param", "optim.lr=log:1e-3:1e-2", "--sweeps-dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        folder = _wait(lambda: next((p for p in tmp_path.iterdir() if (p / "study.journal").exists()), None))

        def trial_1_training():
            m = folder / "trial-0001" / "metrics.jsonl"
            return m.exists() and '"kind":"train"' in m.read_text()

        _wait(trial_1_training)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    before = load_journal(folder).trials
    assert [t.state for t in before[:2]] == [ts.COMPLETE, ts.RUNNING]  # the journal as the kill left it
    lost_params = before[1].params
    # The trial's own process dies with its sweep (it is not left training, holding the lane).
    _wait(lambda: json.loads((folder / "trial-0001" / "status.json").read_text())["state"] != "running", 300)

    r = sweep_cli("sweep", "--resume", str(folder), "--devices", "cpu:0,cpu:1")
    assert r.returncode == 0, r.stderr + r.stdout
    assert "trials 1 had lost their process" in r.stdout
    after = load_journal(folder).trials
    assert after[0].state == ts.COMPLETE and after[0].value == before[0].value  # kept as it was
    assert after[1].state == ts.FAIL and after[1].user_attrs["lost"]
    assert all(t.state != ts.RUNNING for t in after)
    done = [t for t in after if t.state in (ts.COMPLETE, ts.PRUNED)]
    assert len(done) == 3  # the asked count
    requeued = [t for t in after if t.user_attrs.get("requeued_from") == 1]
    assert len(requeued) == 1 and requeued[0].params == lost_params
    assert sweep_folder(tmp_path) == folder
