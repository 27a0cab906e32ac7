"""A rank that refuses to run is said once, by the launcher, with exit 2, as the one-process path says it.

A rank finds bad input the launcher could not see (a setting its device cannot take, a model that
cannot be built there, a damaged checkpoint: ``UserError`` before the run began). It prints nothing
and writes nothing into the run folder; its line goes to its node's launcher, which prints it once,
exits 2, and leaves the run folder as it found it (a folder it made for the run is removed, as the
one-process path makes none). A rank that crashes is still a failure, reported once.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from helpers import CLI
from multilane.engine.distributed import NODE_FILE_ENV
from multilane.engine.distributed.failures import FolderAsFound, refusal, write_refusal
from multilane.engine.rundir.run_lock import LOCK, lock_run_folder

REFUSING_TASK = """
import os
from multilane.engine.tasks.builtin import BUILTIN_TASKS

class RefusesOnRankOne(BUILTIN_TASKS["linear"]):
    name = "refuses-on-rank-one"

    def build_model(self):
        if os.environ.get("RANK") == "1" and os.environ.get("REFUSE_ON_RANK_1"):
            raise ValueError("no model for rank 1")
        return super().build_model()
"""


def test_the_launcher_says_the_rank_s_own_refusal_not_a_peer_s_lost_connection(tmp_path, monkeypatch):
    monkeypatch.delenv(NODE_FILE_ENV, raising=False)
    assert not write_refusal(0, "bare torchrun: the rank says it itself", False)
    monkeypatch.setenv(NODE_FILE_ENV, str(tmp_path / "run_dir"))
    lost = "task t: setup failed at x.py:3: RuntimeError: Connection closed by peer"
    assert write_refusal(0, lost, True)
    assert refusal(tmp_path) is None  # only a rank that lost its peers: a crash elsewhere is the news
    assert write_refusal(1, "devices: local rank 1 has no device", False)
    time.sleep(0.01)
    assert write_refusal(2, "a later refusal", False)
    assert refusal(tmp_path) == "devices: local rank 1 has no device"


def test_a_refused_resume_puts_back_the_lock_file_a_killed_rank_0_left(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / LOCK).write_bytes(b"111\nfinished-host\n")
    os.utime(run / LOCK, ns=(1_000_000_000, 2_000_000_000))
    found = FolderAsFound(run, made_here=False)
    lock_run_folder(run).release()  # rank 0 took it (writing its pid) and was killed
    assert (run / LOCK).read_bytes() != b"111\nfinished-host\n"
    found.restore()
    assert (run / LOCK).read_bytes() == b"111\nfinished-host\n"
    assert (run / LOCK).stat().st_mtime_ns == 2_000_000_000


def test_a_folder_the_launcher_made_goes_while_it_holds_only_what_making_it_wrote(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / LOCK).write_bytes(b"1\n")
    found = FolderAsFound(run, made_here=True)
    held = lock_run_folder(run)
    found.restore()  # held: another process writes it
    assert run.is_dir()
    held.release()
    (run / "checkpoints" / "last.pt").write_bytes(b"x")
    found.restore()
    assert run.is_dir()
    (run / "checkpoints" / "last.pt").unlink()
    found.restore()
    assert not run.exists()


def tree(folder: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None) for p in folder.rglob("*")}


def train(*args: str, refuse: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "REFUSE_ON_RANK_1": "1"} if refuse else None
    return subprocess.run([*CLI, "train", *args], capture_output=True, text=True, timeout=180, env=env)


REFUSAL = "multilane: error: task refuses-on-rank-one: setup failed at refusing.py:10: ValueError: no model for rank 1"


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_refusal_found_in_one_rank_is_one_line_exit_2_and_leaves_no_run_folder(tmp_path, strategy):
    task = tmp_path / "refusing.py"
    task.write_text(REFUSING_TASK)
    runs = tmp_path / "runs"
    runs.mkdir()
    args = ["--strategy", strategy, "--task", str(task), "--devices", "cpu:0,cpu:1", "--steps", "2"]
    r = train(*args, "--runs-dir", str(runs), refuse=True)
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.splitlines() == [REFUSAL], r.stderr
    assert "no model" not in r.stdout
    assert list(runs.iterdir()) == []  # as the one-process path: no folder for a run that never began


@pytest.mark.slow
def test_a_resume_one_rank_refuses_leaves_the_finished_run_folder_byte_for_byte(tmp_path):
    task = tmp_path / "refusing.py"
    task.write_text(REFUSING_TASK)
    runs = tmp_path / "runs"
    args = ["--strategy", "ddp", "--task", str(task), "--devices", "cpu:0,cpu:1", "--runs-dir", str(runs)]
    r = train(*args, "--steps", "2", "--set", "telemetry.enabled=false")
    assert r.returncode == 0, r.stderr[-3000:]
    (run,) = runs.iterdir()
    before = tree(run)
    assert ".lock" in before and "status.json" in before
    r = train("--resume", str(run), "--steps", "4", refuse=True)
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.splitlines() == [REFUSAL], r.stderr
    assert tree(run) == before
    assert json.loads((run / "status.json").read_text())["state"] == "finished"
