"""A run's recorded state is true. A refused resume of a live
run, by any strategy, writes nothing into it; a refused resume leaves a folder as it found it; and
status.json's step follows the run."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import CLI
from multilane.engine.run.trainer import Trainer
from multilane.engine.rundir.runlog import read_metrics

pytestmark = pytest.mark.timeout(300)


def wait_for(predicate, timeout=120.0, what="the condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def status_of(run: Path) -> dict:
    return json.loads((run / "status.json").read_text())


def train_steps(run: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run) if r["kind"] == "train"]


def names(run: Path) -> set[str]:
    return {p.name for p in run.iterdir()} | {f"checkpoints/{p.name}" for p in (run / "checkpoints").iterdir()}


def live_resume(run: Path) -> subprocess.Popen:
    """``multilane train --resume RUN`` for far more steps than a test waits for: the live run."""
    args = [*CLI, "train", "--resume", str(run), "--steps", "1000000", "--set", "telemetry.enabled=false"]
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(30)


@pytest.fixture
def finished_run(make_config) -> Path:
    cfg = make_config(task__name="linear", train__steps=2, devices__use="cpu:0", telemetry__enabled=False)
    return Trainer(cfg).run().run_dir


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy",
    [
        ["--strategy", "ddp", "--devices", "cpu:0,cpu:1"],
        ["--strategy", "replicate", "--devices", "cpu:0,cpu:1"],
    ],
    ids=["ddp", "replicate"],
)
def test_a_refused_resume_of_a_live_run_writes_nothing_into_it(finished_run, strategy):
    run = finished_run
    live = live_resume(run)
    try:
        wait_for(lambda: len(train_steps(run)) > 5, what="the live run to train")
        before = names(run)
        second = subprocess.run(
            [*CLI, "train", "--resume", str(run), *strategy], capture_output=True, text=True, timeout=180
        )
        assert second.returncode == 2, second.stderr
        assert second.stderr.strip() == (
            f"multilane: error: run {run} is in use by pid {live.pid}; one run writes to a folder at a time"
        )
        time.sleep(0.5)  # anything the refused launch might still write would be there now
        # no error.txt, no failures/, no console.log (health_layers.jsonl: the live run's own, at its step 50)
        assert names(run) - {"health_layers.jsonl"} == before - {"health_layers.jsonl"}
        assert status_of(run)["state"] == "running"
        assert not [r for r in read_metrics(run) if r["kind"] == "event" and r["event"] == "failed"]
        assert live.poll() is None  # the live run trains on
    finally:
        kill(live)


@pytest.mark.slow
def test_a_live_run_without_a_checkpoint_yet_is_in_use_not_without_a_checkpoint(tmp_path):
    runs = tmp_path / "runs"
    args = [*CLI, "train", "--task", "linear", "--steps", "1000000", "--devices", "cpu:0", "--runs-dir", str(runs)]
    live = subprocess.Popen([*args, "--set", "telemetry.enabled=false"], stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: any(runs.glob("*/metrics.jsonl")), what="the run to start")
        (run,) = [p for p in runs.iterdir() if not p.name.startswith(".")]
        assert not (run / "checkpoints" / "last.pt").exists()  # the cadence is 5 minutes
        for strategy in ("replicate", "ddp"):
            second = subprocess.run(
                [*CLI, "train", "--resume", str(run), "--strategy", strategy],
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert second.returncode == 2
            assert f"is in use by pid {live.pid}" in second.stderr, second.stderr
    finally:
        kill(live)


@pytest.mark.slow
def test_a_refused_resume_leaves_no_lock_file_it_made(finished_run, tmp_path):
    run = finished_run
    (run / ".lock").unlink()  # a folder copied without it, or written by an older version
    (run / "checkpoints" / "last.pt").write_bytes(b"not a checkpoint")
    before = names(run)
    out = subprocess.run([*CLI, "train", "--resume", str(run)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.startswith("multilane: error: ")
    assert names(run) == before


@pytest.mark.slow
def test_a_refused_resume_of_a_changed_task_file_leaves_no_lock_file(tmp_path, make_config):
    task = tmp_path / "mytask.py"
    task.write_text("from multilane.engine.tasks.builtin import LinearTask\nclass T(LinearTask):\n    name = 't'\n")
    cfg = make_config(task__name=str(task), train__steps=2, devices__use="cpu:0", telemetry__enabled=False)
    run = Trainer(cfg).run().run_dir
    (run / ".lock").unlink()
    task.write_text(task.read_text() + "# changed\n")
    before = names(run)
    more = ["--steps", "4"]  # the run finished its 2: a resume with more to train, refused for its task file
    out = subprocess.run([*CLI, "train", "--resume", str(run), *more], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "changed" in out.stderr
    assert names(run) == before


@pytest.mark.slow
def test_status_json_step_follows_the_run_at_log_time(finished_run):
    run = finished_run
    live = live_resume(run)
    try:
        wait_for(lambda: len(train_steps(run)) > 50, what="the live run to train")
        wait_for(lambda: status_of(run).get("step", 0) > 10, timeout=30, what="status.json's step to move")
        logged = train_steps(run)[-1]
        status = status_of(run)
        assert status["state"] == "running"
        # at most a second behind the train records
        wait_for(lambda: status_of(run)["step"] >= logged, timeout=10, what="status.json to catch up")
    finally:
        kill(live)


@pytest.mark.slow
def test_the_apps_resume_of_a_live_run_is_refused_before_a_process_starts(finished_run):
    from multilane.engine.errors import UserError
    from multilane.gui.runs.child_run import ChildRun

    run = finished_run
    live = live_resume(run)
    try:
        wait_for(lambda: len(train_steps(run)) > 5, what="the live run to train")
        before = names(run)
        with pytest.raises(UserError, match=f"in use by pid {live.pid}"):
            ChildRun.resume(run)
        assert names(run) == before and "console.log" not in before
    finally:
        kill(live)


def test_the_apps_refused_resume_puts_console_log_back(finished_run):
    from multilane.gui.runs.child_run import ChildRun

    run = finished_run
    (run / "checkpoints" / "last.pt").write_bytes(b"broken")  # refused by the child, at exit 2
    before = names(run)
    child = ChildRun(["--resume", str(run)], run, made_folder=False)
    assert child.wait(120)
    outcome = child.outcome(step=0)
    assert outcome["status"] == "rejected", outcome
    assert "checkpoint" in outcome["message"]
    assert names(run) == before and status_of(run)["state"] == "finished"


@pytest.fixture
def tiny_disk(tmp_path):
    """A real 1 MiB file system (tmpfs): needs root and mount; skipped elsewhere."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill_until(folder: Path, free_bytes: int) -> None:
    import os

    with open(folder / "filler", "wb") as f:
        while True:
            st = os.statvfs(folder)
            left = st.f_bavail * st.f_frsize
            if left <= free_bytes:
                return
            try:
                f.write(b"\0" * min(4096, left - free_bytes))
                f.flush()
            except OSError:
                return


@pytest.mark.slow
@pytest.mark.parametrize("free_kib", [36, 6])
def test_a_nearly_full_disk_is_refused_up_front_with_the_free_space(tiny_disk, free_kib):
    runs = tiny_disk / "runs"
    runs.mkdir()
    _fill_until(tiny_disk, free_kib << 10)
    out = subprocess.run(
        [*CLI, "train", "--task", "linear", "--devices", "cpu:0", "--steps", "60", "--runs-dir", str(runs)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 2, (out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "KiB free" in lines[0] and "at least 1 MiB" in lines[0], out.stderr
    assert "error.txt" not in out.stderr
    assert not [p for p in runs.iterdir() if not p.name.startswith(".")]  # no run folder that lies
