"""A Ctrl+C whose ``KeyboardInterrupt`` is lost on the way (raised in a finalizer: "Exception ignored",
or caught by a library) is still answered: ``watch`` stops following, ``train`` stops before step 1.
The press is lost for real here: the process sends itself SIGINT from inside an object's ``__del__``."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each test starts a fresh interpreter (and `watch` or `train` in it)

LOSE_A_PRESS = """
import os, signal, sys
from multilane.engine.cli import main
from multilane.engine.cli.interrupts import note_ctrl_c

note_ctrl_c()  # what main() does first


class Finalizer:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(10000):  # Python's handler runs here: its KeyboardInterrupt is ignored, and lost
            pass


Finalizer()
print("a press was lost", flush=True)
sys.exit(main(sys.argv[1:]))
"""


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", LOSE_A_PRESS, *argv], capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    from multilane.engine.config import build_config
    from multilane.engine.run.trainer import Trainer

    runs = tmp_path_factory.mktemp("runs")
    cfg = {"task": {"name": "linear"}, "devices": {"use": "cpu:0"}, "train": {"steps": 2}}
    cfg["run"] = {"runs_dir": str(runs), "name": "w"}
    return Trainer(build_config(cfg)).run().run_dir


def test_watch_answers_a_press_it_never_saw_raised(finished, tmp_path):
    from multilane.engine.rundir.run_lock import lock_run_folder

    run = Path(shutil.copytree(finished, tmp_path / "run"))
    status = json.loads((run / "status.json").read_text()) | {"state": "running"}
    (run / "status.json").write_text(json.dumps(status))
    lock = lock_run_folder(run)  # a live writer: watch would follow until Ctrl+C
    try:
        out = _run("watch", str(run))  # before: it followed until the timeout
    finally:
        lock.release(force=True)
    assert "a press was lost" in out.stdout and "KeyboardInterrupt" in out.stderr, out.stderr  # "Exception ignored"
    assert out.stderr.count("Traceback") == out.stderr.count("Exception ignored in"), out.stderr  # the lost one's
    assert out.returncode == 0, (out.stdout, out.stderr)


def test_train_stops_before_step_1_on_a_press_lost_before_its_handler(tmp_path):
    out = _run("train", "--task", "linear", "--devices", "cpu:0", "--steps", "500", "--runs-dir", str(tmp_path))
    assert "a press was lost" in out.stdout, out.stderr
    assert "stopping" in out.stdout + out.stderr, (out.stdout, out.stderr)
    (run,) = [p for p in tmp_path.iterdir() if (p / "status.json").is_file()]
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "stopped" and status["step"] == 0, status
