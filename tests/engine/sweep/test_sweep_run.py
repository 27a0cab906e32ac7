"""`multilane sweep` as a user runs it: a digits sweep on two CPU lanes, one lane per trial, its study
opened by plain Optuna, its trials ordinary run folders; a trial with an absurd learning rate pruned."""

import json

import pytest
from sweep_helpers import TINY, last_step, load_journal, sweep_cli, sweep_folder

pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def four_trial_sweep(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweeps")
    r = sweep_cli(
        "sweep", *TINY, "--devices", "cpu:0,cpu:1", "--trials", "4", "--seed", "7", "--sweeps-dir", str(root),
        "--param", "optim.lr=log:1e-3:1e-2", "--param", "task.params.hidden=int:16:64", "--pruner", "none",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr + r.stdout
    return sweep_folder(root), r


@pytest.mark.slow
def test_four_trial_sweep_on_two_lanes_leaves_a_study_optuna_opens_and_a_run_folder_per_trial(four_trial_sweep):
    import optuna

    folder, r = four_trial_sweep
    study = load_journal(folder)
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * 4
    # One lane per trial and both lanes used, at the same time: a slot takes the next trial as soon as
    # its own ends, so a lane whose trials run faster may take three of the four (it did under load).
    assert {t.user_attrs["devices"] for t in study.trials} == {"cpu:0", "cpu:1"}
    first = {lane: min((t for t in study.trials if t.user_attrs["devices"] == lane), key=lambda t: t.number)
             for lane in ("cpu:0", "cpu:1")}  # fmt: skip
    a, b = first["cpu:0"], first["cpu:1"]
    assert a.datetime_start < b.datetime_complete and b.datetime_start < a.datetime_complete  # they overlapped
    for t in study.trials:
        run = folder / f"trial-{t.number:04d}"
        assert t.user_attrs["run_dir"] == str(run)
        config = json.loads((run / "config.json").read_text())
        assert config["devices"]["use"] == t.user_attrs["devices"]
        assert config["optim"]["lr"] == t.params["optim.lr"]
        assert config["task"]["params"]["hidden"] == t.params["task.params.hidden"]
        assert json.loads((run / "status.json").read_text())["state"] == "finished"
        evals = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"eval"' in x]
        assert t.value == pytest.approx(evals[-1]["val_loss"])  # the objective is the run's own last val_loss
    best = study.best_trial
    assert f"best trial {best.number}: val_loss {best.value:.6g}" in r.stdout
    assert f"run folder: {folder / f'trial-{best.number:04d}'}" in r.stdout


@pytest.mark.slow
def test_a_trial_with_an_absurd_learning_rate_is_pruned_before_it_ends(four_trial_sweep):
    import optuna

    folder, _ = four_trial_sweep
    load_journal(folder).enqueue_trial({"optim.lr": 9.5, "task.params.hidden": 32})  # as optuna users do
    # The sweep ran with --pruner none (so that its 4 trials all complete); resumed with the median pruner.
    r = sweep_cli("sweep", "--resume", str(folder), "--devices", "cpu:0", "--trials", "5", "--pruner", "median")
    assert r.returncode == 0, r.stderr + r.stdout
    absurd = load_journal(folder).trials[4]
    assert absurd.params["optim.lr"] == 9.5
    # Pruned at its first evaluation (step 5 of 10): nothing after it was reported to the study. The stop
    # then goes through the control file; a 10-step trial may reach its end before it lands (the app's test
    # prunes a 20,000-step trial by hand and sees it stopped early). The study says what the folder says:
    # stopped early, PRUNED; finished all the same, COMPLETE with the prune noted as too late.
    assert list(absurd.intermediate_values) == [5]
    assert last_step(folder / "trial-0004") <= 10
    state = json.loads((folder / "trial-0004" / "status.json").read_text())["state"]
    if state == "finished":
        assert absurd.state == optuna.trial.TrialState.COMPLETE, r.stdout
        assert absurd.user_attrs["pruned_too_late_at_step"] == 5
    else:
        assert absurd.state == optuna.trial.TrialState.PRUNED and state == "stopped", (state, r.stdout)
        assert absurd.user_attrs["pruned_at_step"] == 5
