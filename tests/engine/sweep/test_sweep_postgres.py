"""Past one machine: a sweep whose study is in a real PostgreSQL server, with a second worker process
(`multilane sweep-worker`) adding its slot to the same sweep."""

import subprocess
import time

import pytest
from helpers import CLI
from postgres import pg_bin, postgres_server
from sweep_helpers import TINY, study_names

pytestmark = [
    pytest.mark.timeout(1800),
    pytest.mark.skipif(pg_bin("initdb") is None, reason="PostgreSQL not installed (.ci/run installs it)"),
]


@pytest.mark.slow
def test_two_workers_in_separate_processes_share_one_study_in_postgresql(tmp_path):
    import optuna

    with postgres_server() as url:
        first = subprocess.Popen(
            [*CLI, "sweep", *TINY, "--devices", "cpu:0", "--trials", "3", "--storage", url, "--name", "pg",
             "--param", "optim.lr=log:1e-3:1e-2", "--pruner", "none", "--seed", "3", "--sweeps-dir", str(tmp_path / "a")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        end = time.monotonic() + 600
        while "pg" not in study_names(url):
            assert time.monotonic() < end and first.poll() is None, first.communicate()
            time.sleep(0.5)
        second = subprocess.run(
            [*CLI, "sweep-worker", "--storage", url, "--study", "pg", "--devices", "cpu:1", "--sweeps-dir",
             str(tmp_path / "b")],
            capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        out, err = first.communicate(timeout=900)
        assert first.returncode == 0, err + out
        assert second.returncode == 0, second.stderr + second.stdout
        study = optuna.load_study(study_name="pg", storage=url)
        trials = study.trials
        assert len(trials) == 3
        assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
        pids = {t.user_attrs["worker_pid"] for t in trials}
        assert len(pids) == 2  # both workers ran trials
        assert len({t.params["optim.lr"] for t in trials}) == 3  # with --seed, each worker its own proposals
        assert {t.user_attrs["devices"] for t in trials} == {"cpu:0", "cpu:1"}
        for t in trials:  # each worker's trials are run folders on its own side
            run = t.user_attrs["run_dir"]
            assert run.startswith(str(tmp_path / ("a" if t.user_attrs["devices"] == "cpu:0" else "b")))
            assert (tmp_path / run / "status.json").is_file()
        assert "best trial" in out
