"""Workers that wait: a worker started before its study exists, or at the same moment as the sweep and
other workers on a fresh PostgreSQL (whose first users race to make Optuna's tables), waits (bounded,
one line saying what for) instead of dying."""

import re
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


def test_a_study_missing_from_a_storage_that_holds_another_is_refused_at_once(tmp_path):
    from multilane.engine.sweep.study import Sweep

    made = _made(tmp_path / "made")
    t0 = time.monotonic()
    with pytest.raises(UserError) as e:
        Sweep.join(None, "nosuch", made.folder, wait_s=300)
    assert str(e.value) == "--study 'nosuch': the storage holds no study of that name (it holds 'w')"
    assert time.monotonic() - t0 < 30  # not the 300 s wait


def test_a_worker_gives_up_after_its_wait_in_one_line_and_refuses_a_missing_folder_at_once(tmp_path):
    from multilane.engine.sweep.study import Sweep

    said = []
    t0 = time.monotonic()
    with pytest.raises(UserError) as e:
        Sweep.join(None, "w", tmp_path, wait_s=1.0, say=said.append)
    assert "not found: the study's journal" in str(e.value) and "waited 1 s (--wait S waits longer)" in str(e.value)
    assert 1.0 <= time.monotonic() - t0 < 30
    assert said and said[0].startswith("waiting for the study's journal") and "0 s of 1 s" in said[0]
    t0 = time.monotonic()
    with pytest.raises(UserError) as e:
        Sweep.join(None, "w", tmp_path / "no" / "such", wait_s=300)
    assert "its folder" in str(e.value) and "does not exist" in str(e.value)
    assert time.monotonic() - t0 < 30


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


def _worker(cwd, *args, timeout=120):
    return subprocess.run(
        [*CLI, "sweep-worker", "--devices", "cpu:0", "--no-table", *args],
        cwd=cwd, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


@pytest.mark.slow
def test_sweep_worker_refuses_at_once_what_cannot_appear_and_shows_a_wait_for_what_can(tmp_path):
    import optuna

    # a mistyped folder: one line at once, exit 2
    t0 = time.monotonic()
    r = _worker(tmp_path, "--storage", "sqlite:///nodir/db.sqlite", "--study", "nosuch")
    assert r.returncode == 2 and not r.stdout, r.stdout + r.stderr
    assert r.stderr.strip() == (
        "multilane: error: the study's SQLite database nodir/db.sqlite: its folder nodir does not exist; check the path"
    )
    # a database that holds another study: one line at once naming it
    optuna.create_study(storage=f"sqlite:///{tmp_path / 'real.sqlite'}", study_name="real")
    r = _worker(tmp_path, "--storage", "sqlite:///real.sqlite", "--study", "nosuch")
    assert r.returncode == 2 and "waiting" not in r.stdout, r.stdout + r.stderr
    assert r.stderr.strip() == (
        "multilane: error: --study 'nosuch': the storage holds no study of that name (it holds 'real')"
    )
    assert time.monotonic() - t0 < 120  # neither waited the default 300 s
    # a database file not there yet in a folder that is: a shown wait, bounded by --wait
    t0 = time.monotonic()
    r = _worker(tmp_path, "--storage", "sqlite:///db.sqlite", "--study", "nosuch", "--wait", "11")
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("sweep-worker: waiting for the study's SQLite database db.sqlite"), r.stdout
    assert re.search(r": \d s of 11 s \(--wait S sets the limit; Ctrl\+C gives up\)$", lines[0]), r.stdout
    assert any(x.startswith("sweep-worker: still waiting for") and re.search(r": 1\d s of 11 s", x) for x in lines)
    assert len(r.stderr.strip().splitlines()) == 1 and "waited 11 s (--wait S waits longer)" in r.stderr
    assert 11 <= time.monotonic() - t0 < 90
    assert not (tmp_path / "db.sqlite").exists()  # a worker never makes the study's database
