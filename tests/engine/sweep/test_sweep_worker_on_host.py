"""Past one machine, over SSH: `multilane sweep-worker --host` starts a worker on a host (a real sshd on
127.0.0.1) that adds its slot to a sweep whose study is in a real PostgreSQL server, beside the local
sweep's slot. The database's password is on no command line there and in no log; stopping the worker
leaves no process of it and its running trial recorded failed and re-queued, never "running"."""

import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from helpers import CLI
from postgres import pg_bin, postgres_server
from sshd_server import MULTILANE
from sweep_helpers import TINY, study_names

pytestmark = [
    pytest.mark.timeout(1800),
    pytest.mark.skipif(pg_bin("initdb") is None, reason="PostgreSQL not installed (.ci/run installs it)"),
]

# The fixture's server trusts 127.0.0.1, so it ignores the password; what is checked is that the URL a
# user gives, password and all, works and that the password shows nowhere on the host.
PASSWORD = "h25w-Pg-s3cret"


def with_password(url: str) -> str:
    return url.replace("postgres@", f"postgres:{PASSWORD}@")


def wait_for(predicate, timeout: float, what: str):
    end = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.3)


def host_ps(conn) -> str:
    """Every process's command line on the host, as any user there sees them."""
    code, out, _ = conn.run("ps -eo pid,args", login=False)
    assert code == 0 and "PID" in out
    return out


@pytest.mark.slow
def test_a_worker_started_over_ssh_and_a_local_sweep_share_one_study_and_no_password_shows(sshd, ssh_home, tmp_path):
    import optuna
    from multilane.engine.remote.connection import Connection

    with postgres_server() as plain:
        url = with_password(plain)
        # The local sweep reads the URL from its standard input too (`--storage -`): on this test machine the
        # "host" is this machine, whose `ps` would otherwise show it on the local sweep's command line.
        local = subprocess.Popen(
            [*CLI, "sweep", *TINY, "--steps", "40", "--devices", "cpu:0", "--trials", "4", "--name", "shared",
             "--param", "optim.lr=log:1e-3:1e-2", "--pruner", "none", "--sweeps-dir", str(tmp_path / "here"),
             "--no-table", "--storage", "-"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=sshd.env(),
        )  # fmt: skip
        local.stdin.write(url + "\n")
        local.stdin.close()
        wait_for(lambda: "shared" in study_names(url) or local.poll() is not None, 600, "the study")
        assert local.poll() is None, local.communicate()
        r = subprocess.run(
            [*CLI, "sweep-worker", "--host", "testhost", "--remote-command", MULTILANE, "--storage", url,
             "--study", "shared", "--devices", "cpu:1", "--sweeps-dir", str(sshd.runs), "--detach"],
            capture_output=True, text=True, timeout=300, env=sshd.env(),
        )  # fmt: skip
        assert r.returncode == 0, r.stderr + r.stdout
        assert PASSWORD not in r.stdout + r.stderr
        m = re.search(r"sweep-worker on testhost: pid (\d+) · console log testhost:(\S+)", r.stdout)
        assert m, r.stdout
        pid, log = int(m[1]), m[2]
        assert f"--stop {pid}" in r.stdout

        with Connection("testhost", remote_command=MULTILANE) as conn:
            # The worker runs there in its own session, and while its trial trains nothing shows the password.
            def a_remote_trial_trains():
                ps = host_ps(conn)
                assert PASSWORD not in ps
                return f"{pid} " in ps and "sweep-worker" in ps and str(sshd.runs / "shared") in ps and ps

            ps = wait_for(a_remote_trial_trains, 600, "a trial of the remote worker")
            assert os.getsid(pid) == pid
            procs = [
                p
                for p in psutil.process_iter(["cmdline"])
                if str(sshd.runs / "shared") in " ".join(p.info["cmdline"] or [])
            ]
            assert procs, ps
            for p in [psutil.Process(pid), *procs]:  # not even in their environments (nor in a file)
                try:
                    assert PASSWORD not in " ".join(f"{k}={v}" for k, v in p.environ().items())
                except psutil.NoSuchProcess:
                    pass
            local.stdin = None  # written and closed above
            out, err = local.communicate(timeout=900)
            assert local.returncode == 0, err + out
            wait_for(lambda: not _session_alive(pid), 600, "the remote worker to finish")
        text = Path(log).read_text(encoding="utf-8")
        assert "sweep-worker shared" in text and PASSWORD not in text
        assert PASSWORD not in out + err

        trials = optuna.load_study(study_name="shared", storage=plain).trials
        assert len(trials) == 4 and all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
        workers = {t.user_attrs["worker"] for t in trials}
        assert workers == {"testhost", socket.gethostname()}  # trials ran in both, each names where
        for t in trials:  # each worker's trial folders on its own side
            side = sshd.runs if t.user_attrs["worker"] == "testhost" else tmp_path / "here"
            assert t.user_attrs["run_dir"].startswith(str(side))


def _session_alive(sid: int) -> bool:
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid:
                return True
        except (ProcessLookupError, PermissionError):
            continue
    return False


@pytest.mark.slow
def test_stopping_a_remote_worker_mid_trial_leaves_no_process_and_re_queues_its_trial(sshd, ssh_home, tmp_path):
    """Without --detach the command shows the worker's log; Ctrl+C stops the worker there."""
    import optuna
    from multilane.engine.sweep.space import parse_params
    from multilane.engine.sweep.spec import SweepSpec
    from multilane.engine.sweep.study import Sweep

    with postgres_server() as plain:
        url = with_password(plain)
        base = {"task": {"name": "digits"}, "train": {"steps": 100000, "log_every": 5, "eval_every": 5}}
        spec = SweepSpec("digits", parse_params(["optim.lr=log:1e-3:1e-2"], "digits"), 2, base, pruner="none",
                         name="long")  # fmt: skip
        Sweep.create(spec, tmp_path / "here", url)  # the study, as `multilane sweep --storage` makes it
        cli = subprocess.Popen(
            [*CLI, "sweep-worker", "--host", "testhost", "--remote-command", MULTILANE, "--storage", "-",
             "--study", "long", "--devices", "cpu:0", "--sweeps-dir", str(sshd.runs)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=sshd.env(),
        )  # fmt: skip
        cli.stdin.write(url + "\n")
        cli.stdin.close()
        first = cli.stdout.readline()
        m = re.search(r"sweep-worker on testhost: pid (\d+) · console log testhost:(\S+)", first)
        assert m, first + cli.stdout.read()
        pid, log = int(m[1]), m[2]
        study = optuna.load_study(study_name="long", storage=plain)

        def training():
            running = study.get_trials(states=(optuna.trial.TrialState.RUNNING,))
            return running and running[0].intermediate_values and running[0]

        trial = wait_for(training, 600, "the remote trial to report an evaluation")
        assert trial.user_attrs["worker"] == "testhost" and _session_alive(pid)
        cli.send_signal(signal.SIGINT)
        cli.stdin = None  # written and closed above
        out, _ = cli.communicate(timeout=300)
        assert cli.returncode == 130, out
        assert f"sweep-worker {pid} on testhost: stopped" in out
        assert "sweep-worker long · trial folders in" in out  # the worker's log, shown as it grew
        assert not _session_alive(pid)  # the worker and its trial process: gone
        trials = {t.number: t for t in study.get_trials()}
        stopped = trials[trial.number]
        assert stopped.state == optuna.trial.TrialState.FAIL and stopped.user_attrs["lost"]
        assert not [t for t in trials.values() if t.state == optuna.trial.TrialState.RUNNING]
        (again,) = [t for t in trials.values() if t.state == optuna.trial.TrialState.WAITING]
        assert again.system_attrs["fixed_params"] == stopped.params  # Optuna's enqueued parameters
        assert again.user_attrs["requeued_from"] == trial.number
        text = Path(log).read_text(encoding="utf-8")
        assert PASSWORD not in text + out and "stopping the sweep" in text
        r = subprocess.run(
            [*CLI, "sweep-worker", "--host", "testhost", "--remote-command", MULTILANE, "--stop", str(pid)],
            capture_output=True, text=True, timeout=120, env=sshd.env(),
        )  # fmt: skip
        assert r.returncode == 0 and f"sweep-worker {pid} on testhost: stopped" in r.stdout, r.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    ("storage", "what"),
    [(None, "study.journal"), ("sqlite:///sweeps/s.db", "SQLite"), ("sweeps/x/study.journal", "a journal file")],
)
def test_a_study_in_a_local_file_cannot_go_to_a_host_one_line(storage, what, tmp_path):
    args = [*CLI, "sweep-worker", "--host", "testhost", "--study", "s", "--devices", "cpu:0"]
    if storage:
        args += ["--storage", storage]
    r = subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 2
    (line,) = r.stderr.splitlines()
    assert line.startswith("multilane: error: a worker on a host needs the sweep's study in an RDB storage")
    assert what in line and "postgresql" in line


def test_a_workers_folder_holding_an_earlier_studys_trial_of_the_same_name_keeps_both(tmp_path):
    # A worker's trial folders go in <sweeps-dir>/<study>: a later study of the same name meets the earlier
    # one's trial-0000 there. It runs beside it, and a trial that cannot start is never left "running".
    from multilane.engine.sweep.runner import SweepRunner
    from multilane.engine.sweep.space import parse_params
    from multilane.engine.sweep.spec import SweepSpec
    from multilane.engine.sweep.study import Sweep

    base = {"task": {"name": "digits"}, "train": {"steps": 5, "log_every": 5, "eval_every": 5}}
    spec = SweepSpec("digits", parse_params(["optim.lr=log:1e-3:1e-2"], "digits"), 1, base, pruner="none")
    sweep = Sweep.create(spec, tmp_path)
    earlier = sweep.folder / "trial-0000"
    earlier.mkdir()
    (earlier / "config.json").write_text("{}\n")
    runner = SweepRunner(sweep, ["cpu:0"], 1)
    runner.start()
    assert runner.wait(600) and runner.errors == []
    (trial,) = sweep.study.trials
    assert trial.state.name == "COMPLETE" and trial.user_attrs["run_dir"] == str(sweep.folder / "trial-0000-2")
    assert (earlier / "config.json").read_text() == "{}\n"  # the earlier study's folder, untouched
