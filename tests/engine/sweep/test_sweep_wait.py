"""Workers that wait: a worker started before its study exists, or at the same moment as the sweep and
other workers on a fresh PostgreSQL (whose first users race to make Optuna's tables), waits (bounded,
one line saying what for) instead of dying."""

import shutil
import subprocess
import threading
import time

import pytest
from helpers import CLI
from multilane.engine.errors import UserError
from postgres import pg_bin, postgres_server
from sweep_helpers import TINY

pytestmark = pytest.mark.timeout(1800)


def _made(tmp_path):
    from multilane.engine.sweep.space import parse_params
    from multilane.engine.sweep.spec import SweepSpec
    from multilane.engine.sweep.study import Sweep

    params = parse_params(["optim.lr=log:1e-4:1e-1"], "digits")
    return Sweep.create(SweepSpec(task="digits", params=params, trials=2, name="w"), tmp_path)


def test_a_worker_waits_for_a_study_that_appears_and_says_once_what_it_waits_for(tmp_path):
    from multilane.engine.sweep.study import Sweep

    made = _made(tmp_path / "made")
    folder = tmp_path / "worker"
    folder.mkdir()
    timer = threading.Timer(1.5, shutil.copy, (made.folder / "study.journal", folder / "study.journal"))
    timer.start()
    said = []
    sweep = Sweep.join(None, "w", folder, wait_s=120, say=said.append)
    timer.join()
    assert sweep.spec.name == "w" and sweep.spec.trials == 2
    assert len(said) == 1 and "waiting for the study's journal" in said[0] and "120 s" in said[0]


def test_a_worker_gives_up_after_its_wait_in_one_line(tmp_path):
    from multilane.engine.sweep.study import Sweep

    made = _made(tmp_path / "made")
    t0 = time.monotonic()
    with pytest.raises(UserError) as e:
        Sweep.join(None, "nosuch", made.folder, wait_s=1.0)
    assert "a study named 'nosuch'" in str(e.value) and "waited 1 s" in str(e.value)
    assert 1.0 <= time.monotonic() - t0 < 30


@pytest.mark.slow
@pytest.mark.skipif(pg_bin("initdb") is None, reason="PostgreSQL not installed (.ci/run installs it)")
def test_the_sweep_and_two_workers_started_in_the_same_second_on_a_fresh_postgresql_all_work(tmp_path):
    import optuna

    with postgres_server() as url:
        common = [*TINY, "--steps", "4", "--pruner", "none", "--no-table"]
        cmds = [
            [*CLI, "sweep", *common, "--devices", "cpu:0", "--trials", "3", "--storage", url, "--name", "race",
             "--param", "optim.lr=log:1e-3:1e-2", "--sweeps-dir", str(tmp_path / "s")],
            *([*CLI, "sweep-worker", "--storage", url, "--study", "race", "--devices", "cpu:0", "--no-table",
               "--sweeps-dir", str(tmp_path / f"w{i}")] for i in (1, 2)),
        ]  # fmt: skip
        procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for c in cmds]
        outs = [p.communicate(timeout=1500)[0] for p in procs]
        for p, out in zip(procs, outs, strict=True):
            assert p.returncode == 0, out
        study = optuna.load_study(study_name="race", storage=url)
        done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
        assert len(done) >= 3  # the count is checked as each trial starts: a worker may start one more
        assert not any(t.state == optuna.trial.TrialState.RUNNING for t in study.trials)
