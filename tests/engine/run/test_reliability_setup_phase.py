"""A run is seen from before any of its task's code runs: the run folder exists, "starting" with the phase
of its set-up (the fit check's data and model, loading data, building the model), and a stop reaches it
there (the control file, SIGTERM, the app's Stop in its thread), ending the run "stopped" on disk; a
crash there ends it "failed" with its traceback and one line. A task whose data() never returns is the
case that found it: it left no folder, so nothing could see or stop it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from helpers import CLI
from multilane.engine.config import build_config
from multilane.engine.run.control import RunControl
from multilane.engine.run.trainer import Trainer
from multilane.engine.rundir.control_file import write_control
from multilane.engine.tasks.builtin import LinearTask

HEAD = "import os, time\nfrom torch import nn\nfrom multilane.engine.tasks.builtin import LinearTask\n"
TASKS = {
    "HangData": (
        "class HangData(LinearTask):\n"
        "    name = 'hang_data'\n"
        "    def data(self):\n"
        "        open(os.environ['HANG_FLAG'], 'a').close()\n"
        "        time.sleep(3600)  # a download that never answers: blocked in C\n"
        "        return super().data()\n"
    ),
    "HangModel": (
        "class HangModel(LinearTask):\n"
        "    name = 'hang_model'\n"
        "    def build_model(self):\n"
        "        open(os.environ['HANG_FLAG'], 'a').close()\n"
        "        time.sleep(3600)\n"
        "        return nn.Linear(10, 1)\n"
    ),
    "CrashData": (
        "class CrashData(LinearTask):\n"
        "    name = 'crash_data'\n"
        "    def data(self):\n"
        "        raise ValueError('no such dataset')\n"
    ),
}


def _status(folder: Path) -> dict:
    try:
        return json.loads((folder / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def _wait(what, timeout=120.0, proc=None):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = what()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the process ended first: {proc.communicate()[0]}")
        time.sleep(0.1)
    raise AssertionError("timed out")


class _Waiting(LinearTask):
    """data() waits on an event, in Python (a loop), as a slow reader does."""

    name = "waiting"
    entered = threading.Event()

    def data(self):
        type(self).entered.set()
        while True:
            time.sleep(0.02)


def _config(tmp_path):
    return build_config(
        {
            "task": {"name": "linear"},
            "devices": {"use": "cpu:0"},
            "train": {"steps": 3},
            "telemetry": {"enabled": False},
            "run": {"runs_dir": str(tmp_path), "name": "r"},
        }
    )


def test_a_run_stuck_in_its_data_shows_starting_and_the_control_files_stop_ends_it_stopped(tmp_path):
    _Waiting.entered.clear()
    trainer = Trainer(_config(tmp_path), task=_Waiting(_Waiting.Params()))
    seen = {}

    def stop_when_seen():
        _Waiting.entered.wait(60)
        (folder,) = tmp_path.iterdir()
        seen.update(_status(folder))
        write_control(folder, "stop")  # what `multilane control RUN stop` writes

    t = threading.Thread(target=stop_when_seen)
    t.start()
    result = trainer.run()  # in this (the main) thread: the stop comes as a signal
    t.join()
    assert seen["state"] == "starting" and seen["phase"].endswith("loading data"), seen
    assert result.status == "stopped" and result.step == 0
    status = _status(result.run_dir)
    assert status["state"] == "stopped"
    assert status["message"].startswith(f"stopped while {seen['phase']}, before step 1"), status
    assert (result.run_dir / "config.json").is_file()


def test_the_apps_stop_ends_a_set_up_running_in_its_thread(tmp_path):
    _Waiting.entered.clear()
    control = RunControl()
    trainer = Trainer(_config(tmp_path), task=_Waiting(_Waiting.Params()), control=control)
    out = []
    t = threading.Thread(target=lambda: out.append(trainer.run()))
    t.start()
    assert _Waiting.entered.wait(60)
    control.request_stop()  # the window's Stop: from the GUI thread
    t.join(60)
    assert not t.is_alive()
    assert out[0].status == "stopped" and _status(out[0].run_dir)["state"] == "stopped"


def _train(tmp_path, task, *extra, fit_check="0"):
    (tmp_path / "tasks.py").write_text(HEAD + TASKS[task])
    env = {**os.environ, "HANG_FLAG": str(tmp_path / "hung"), "MULTILANE_FIT_CHECK": fit_check}
    return subprocess.Popen(
        [*CLI, "train", "--task", str(tmp_path / "tasks.py"), "--steps", "5", "--runs-dir",
         str(tmp_path / "runs"), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip


def _folder(tmp_path) -> Path:
    runs = tmp_path / "runs"
    return next(iter(runs.iterdir())) if runs.is_dir() and any(runs.iterdir()) else None


@pytest.mark.slow
@pytest.mark.parametrize(
    "task, extra, fit, phase, stop",
    [
        ("HangData", ["--devices", "cpu:0"], "1", "checking the fit: loading data", "control"),
        ("HangData", ["--devices", "cpu:0"], "0", "loading data", "sigterm"),
        ("HangModel", ["--devices", "cpu:0"], "0", "building the model", "sigterm"),
        ("HangData", ["--devices", "cpu:0,cpu:1", "--strategy", "ddp"], "0", "loading data", "control"),  # rank 0
        ("HangData", ["--devices", "cpu:0,cpu:1", "--strategy", "ddp"], "1", "checking the fit", "sigterm"),  # launcher
    ],
)
def test_a_cli_run_hung_in_its_set_up_is_seen_by_watch_and_a_stop_ends_it(tmp_path, task, extra, fit, phase, stop):
    proc = _train(tmp_path, task, *extra, fit_check=fit)
    try:
        _wait(lambda: (tmp_path / "hung").exists(), proc=proc)
        folder = _folder(tmp_path)
        assert folder is not None  # the folder was there before the task's code ran
        status = _wait(lambda: str(_status(folder).get("phase")).endswith(phase) and _status(folder), proc=proc)
        assert status["state"] == "starting" and status["message"] == status["phase"]
        phase = status["phase"]  # "checking the fit: loading data" where the fit check runs it, else "loading data"
        try:
            watch = subprocess.run([*CLI, "watch", str(folder)], capture_output=True, text=True, timeout=8)
            shown = watch.stdout + watch.stderr
        except subprocess.TimeoutExpired as e:  # watch follows a live run: what it printed first is the point
            shown = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        assert shown.startswith(f"starting: step 0 ({phase})"), shown
    finally:
        if stop == "control":
            subprocess.run([*CLI, "control", str(_folder(tmp_path)), "stop"], capture_output=True, timeout=120)
        else:
            proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    status = _status(folder)
    assert status["state"] == "stopped", status
    assert status["message"].startswith(f"stopped while {phase}, before step 1"), status
    assert "Traceback" not in out


@pytest.mark.slow
def test_a_crash_in_the_set_up_leaves_a_failed_folder_with_its_traceback_and_one_line(tmp_path):
    proc = _train(tmp_path, "CrashData", "--devices", "cpu:0")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 2, out
    line = "task crash_data: setup failed at tasks.py:7: ValueError: no such dataset"
    assert out.splitlines()[-1] == f"multilane: error: {line}", out
    folder = _folder(tmp_path)
    status = _status(folder)
    assert status["state"] == "failed" and status["message"] == line
    assert "ValueError: no such dataset" in (folder / "error.txt").read_text()
