"""Trials never outlive their sweep: whatever ends the sweep (a trial's --trial-timeout, Ctrl+C once or
twice, kill -9 of the sweep), a trial whose step hangs in C code (a time.sleep in its loss) is gone
within the grace (MULTILANE_TRIAL_GRACE_S, 2 s here): stopped through its control file, then SIGTERM to
its process group, then SIGKILL, by the sweep or, when the sweep is gone, by the trial's guard."""

import json
import os
import signal
import subprocess
import time

import psutil
import pytest
from helpers import CLI
from sweep_helpers import load_journal

pytestmark = [pytest.mark.timeout(1800), pytest.mark.slow]

HANG_TASK = (
    "import os, time\n"
    "from multilane.engine.tasks.builtin import LinearTask\n"
    "class Hang(LinearTask):\n"
    "    name = 'hang'\n"
    "    def loss(self, output, target):\n"
    "        open(os.environ['HANG_FLAG'], 'a').close()\n"
    "        time.sleep(3600)  # a step hung in C code: no Python signal handler ends it\n"
    "        return super().loss(output, target)\n"
)
GRACE = 2.0
SLACK = 30.0  # a loaded machine is slow to deliver and reap


def _start(tmp_path, *extra):
    task = tmp_path / "hang_task.py"
    task.write_text(HANG_TASK)
    env = {**os.environ, "MULTILANE_TRIAL_GRACE_S": str(GRACE), "HANG_FLAG": str(tmp_path / "hung")}
    return subprocess.Popen(
        [*CLI, "sweep", "--task", str(task), "--steps", "5", "--devices", "cpu:0", "--trials", "1",
         "--pruner", "none", "--param", "optim.lr=log:1e-3:1e-2", "--objective", "loss:min",
         "--sweeps-dir", str(tmp_path / "sweeps"), "--no-table", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip


def _wait(what, timeout=600.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = what()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError("timed out")


def _trial_pid(tmp_path) -> int:
    def pid():
        lock = next((tmp_path / "sweeps").glob("*/trial-0000/.lock"), None)
        text = lock.read_text().split() if lock else []
        return int(text[0]) if text else None

    return _wait(pid)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _hung(tmp_path, proc) -> int:
    _wait(lambda: (tmp_path / "hung").exists() or proc.poll() is not None)
    assert proc.poll() is None, proc.communicate()[0]
    return _trial_pid(tmp_path)


def test_a_hung_trial_past_its_timeout_is_ended_and_recorded_failed(tmp_path):
    proc = _start(tmp_path, "--trial-timeout", "3")
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out
    assert "1 of 1 trials done" in out
    (trial,) = load_journal(next((tmp_path / "sweeps").iterdir())).trials
    assert trial.state.name == "FAIL" and "timed out after 3 s" in trial.user_attrs["error"]
    assert _gone(trial.user_attrs["trial_pid"])


@pytest.mark.parametrize("how", ["ctrl+c once", "ctrl+c twice", "kill -9"])
def test_a_hung_trial_does_not_outlive_its_sweep(tmp_path, how):
    proc = _start(tmp_path)
    try:
        pid = _hung(tmp_path, proc)
        if how == "kill -9":
            proc.kill()
        else:
            proc.send_signal(signal.SIGINT)
            if how == "ctrl+c twice":
                time.sleep(0.5)
                proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == (-9 if how == "kill -9" else 130), out
        ended = time.monotonic()
        _wait(lambda: _gone(pid), timeout=2 * GRACE + SLACK)
        assert time.monotonic() - ended < 2 * GRACE + SLACK
    finally:
        if proc.poll() is None:
            proc.kill()
    if how == "ctrl+c once":  # stopped by the sweep itself: re-queued, and its folder says it was lost
        status = json.loads(next((tmp_path / "sweeps").glob("*/trial-0000/status.json")).read_text())
        assert status["state"] != "running"


DEEP_TASK = (
    "import os, subprocess, sys, time\n"
    "from torch import nn\n"
    "from multilane.engine.tasks.builtin import LinearTask\n"
    "class Sleepy(nn.Linear):\n"
    "    def forward(self, x):\n"
    "        open(os.environ['HANG_FLAG'], 'a').close()\n"
    "        time.sleep(3600)  # a forward that never returns\n"
    "        return super().forward(x)\n"
    "class Deep(LinearTask):\n"
    "    name = 'deep'\n"
    "    def build_model(self):\n"
    "        marker = os.environ['DEEP_MARKER']\n"
    "        sleep = [sys.executable, '-c', 'import time, sys; time.sleep(3600)', marker]\n"
    "        subprocess.Popen(sleep)  # a helper in the trial's group\n"
    "        subprocess.Popen(sleep, start_new_session=True)  # and one in a session of its own\n"
    "        subprocess.Popen([sys.executable, '-c', 'import subprocess, sys, time; '\n"
    "                          'subprocess.Popen(sys.argv[1:]); time.sleep(3600)', *sleep])  # a grandchild\n"
    "        return Sleepy(10, 1)\n"
)


def _of_trial(sid: int, marker: str, config_part: str) -> list[psutil.Process]:
    """The processes of a trial: its session or group, its cmdline's config path, the task's marker."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            if os.getsid(p.pid) == sid or os.getpgid(p.pid) == sid or marker in cmd or config_part in cmd:
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return found


@pytest.mark.parametrize("way", ["forkserver", "exec"])
def test_ctrl_c_twice_ends_a_hung_trials_whole_tree_within_seconds_at_the_default_grace(tmp_path, way):
    """The default grace (30 s) is the stop's, not the second Ctrl+C's: a few seconds after the sweep
    exits, nothing the trial started is left, however deep (its group, a helper in a session of its own,
    a grandchild), nor the sweep's own server and resource tracker."""
    task = tmp_path / "deep_task.py"
    task.write_text(DEEP_TASK)
    marker = f"deep-marker-{os.getpid()}-{way}"
    env = {k: v for k, v in os.environ.items() if k != "MULTILANE_TRIAL_GRACE_S"}
    env.update(HANG_FLAG=str(tmp_path / "hung"), DEEP_MARKER=marker, MULTILANE_TRIAL_START=way)
    proc = subprocess.Popen(
        [*CLI, "sweep", "--task", str(task), "--steps", "5", "--devices", "cpu:0", "--trials", "1",
         "--pruner", "none", "--param", "optim.lr=log:1e-3:1e-2", "--objective", "loss:min",
         "--sweeps-dir", str(tmp_path / "sweeps"), "--no-table"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    pid = -1
    try:
        pid = _hung(tmp_path, proc)
        sweep_children = psutil.Process(proc.pid).children()  # its server, resource tracker, the guard
        config_part = "trial-0000/config.json"
        before = _of_trial(pid, marker, config_part)
        assert len([p for p in before if marker in " ".join(p.cmdline())]) >= 4, before  # the helpers run
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 130, out
        ended = time.monotonic()
        _wait(lambda: not _of_trial(pid, marker, config_part) and all(_gone(c.pid) for c in sweep_children), 30)
        assert time.monotonic() - ended < 3.0 + 10.0  # the short grace, and a loaded machine's slack
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in _of_trial(pid, marker, "trial-0000/config.json"):  # a failure leaves nothing behind
            p.kill()
