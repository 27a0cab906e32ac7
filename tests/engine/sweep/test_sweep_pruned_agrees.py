"""A trial's study state and its run folder always agree: PRUNED in the study if and only if its
status.json says it stopped because the sweep pruned it (with the step of that evaluation); a run that
reached its end before the pruner's word landed (a prune decided at its last evaluation) is COMPLETE,
its folder "finished", and the study notes the late word (``pruned_too_late_at_step``)."""

import json

import pytest
from sweep_helpers import load_journal, sweep_cli, sweep_folder

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _agree(folder):
    import optuna

    ts = optuna.trial.TrialState
    trials = load_journal(folder).trials
    for t in trials:
        status = json.loads((folder / f"trial-{t.number:04d}" / "status.json").read_text())
        says_pruned = status["state"] == "stopped" and "pruned by the sweep" in (status.get("message") or "")
        assert (t.state == ts.PRUNED) == says_pruned, (t.number, t.state, status)
        if t.state == ts.PRUNED:
            assert f"at its evaluation of step {t.user_attrs['pruned_at_step']}" in status["message"], status
            assert status["step"] >= t.user_attrs["pruned_at_step"]
        if t.state == ts.COMPLETE:
            assert status["state"] == "finished", (t.number, status)
    return trials


def test_the_reported_sweep_pruned_trials_say_so_in_their_folders(tmp_path):
    r = sweep_cli(
        "sweep", "--task", "linear", "--devices", "cpu:0,cpu:1", "--trials", "8", "--param",
        "optim.lr=log:1e-6:3e-1", "--seed", "5", "--set", "train.steps=150", "--set", "train.eval_every=10",
        "--sweeps-dir", str(tmp_path), "--no-table",
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    trials = _agree(sweep_folder(tmp_path))
    # the check above had a prune to check: one that landed (PRUNED), or one decided after its run ended
    # (COMPLETE, noted): which of the two depends on how fast the machine runs 150 steps
    decided = [t for t in trials if t.state.name == "PRUNED" or "pruned_too_late_at_step" in t.user_attrs]
    assert decided, r.stdout


def test_a_prune_decided_at_the_last_evaluation_leaves_a_complete_trial_and_a_finished_folder(tmp_path):
    # one evaluation, at the run's last step: every prune is decided after the run has done its work
    r = sweep_cli(
        "sweep", "--task", "linear", "--devices", "cpu:0", "--trials", "6", "--param",
        "optim.lr=log:1e-6:3e-1", "--seed", "5", "--set", "train.steps=10", "--set", "train.eval_every=10",
        "--sweeps-dir", str(tmp_path), "--no-table",
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    trials = _agree(sweep_folder(tmp_path))
    late = [t for t in trials if "pruned_too_late_at_step" in t.user_attrs]
    assert late, [(t.number, t.state, t.user_attrs) for t in trials]  # the race was run
    assert all(t.state.name == "COMPLETE" and t.user_attrs["pruned_too_late_at_step"] == 10 for t in late)
