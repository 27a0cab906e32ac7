"""A run's recorded state is true, a run folder has one writer, a full disk is
reported and survived, and a resume runs no task file the run did not record."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import CLI
from multilane.engine.errors import UserError
from multilane.engine.run.trainer import Trainer
from multilane.engine.rundir.runlog import RunDir, load_metrics, read_metrics

SLOW = """
import time, torch
from multilane.engine.tasks.builtin import LinearTask

class Slow(LinearTask):
    name = "slow"

    def build_model(self):
        class M(torch.nn.Linear):
            def forward(self, x):
                time.sleep({sleep})
                return super().forward(x)
        return M(10, 1)
"""


def status_of(run: Path) -> dict:
    return json.loads((run / "status.json").read_text())


def events(run: Path) -> list[str]:
    return [r["event"] for r in read_metrics(run) if r["kind"] == "event" and r["event"] != "warning"]


def run_folders(runs: Path) -> list[Path]:
    """The run folders in ``runs`` (not the runs folder's short-lived write probe)."""
    return [p for p in runs.iterdir() if not p.name.startswith(".")] if runs.exists() else []


def only_run(runs: Path) -> Path:
    (run,) = run_folders(runs)
    return run


def wait_for(predicate, timeout=120.0, what="the condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def has_train_records(runs: Path, n: int = 1) -> bool:
    runs_now = run_folders(runs)
    return bool(runs_now) and sum(r["kind"] == "train" for r in read_metrics(runs_now[0])) >= n


def cli(*args, **kw):
    return subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


# -- whatever ends a run, its recorded state says so ----------------------------------------------


def _raising_task(tmp_path: Path, raise_stmt: str) -> Path:
    task = tmp_path / "raises.py"
    task.write_text(
        "import torch\nfrom multilane.engine.tasks.builtin import LinearTask\n"
        "class R(LinearTask):\n    name = 'r'\n    calls = 0\n"
        "    def build_model(self):\n"
        "        class M(torch.nn.Linear):\n"
        "            def forward(self, x):\n"
        "                R.calls += 1\n"
        "                if R.calls == 4:\n"
        f"                    {raise_stmt}\n"
        "                return super().forward(x)\n"
        "        return M(10, 1)\n"
    )
    return task


@pytest.mark.parametrize(
    "raise_stmt,state,words",
    [
        ("raise SystemExit(3)", "failed", "task r, step 4: the task's code called sys.exit(3)"),
        ("raise KeyboardInterrupt", "aborted", "aborted during step 4 (a second Ctrl+C or SIGTERM)"),
    ],
)
def test_systemexit_or_keyboardinterrupt_in_a_step_is_recorded_as_such_never_finished(
    tmp_path, make_config, raise_stmt, state, words
):
    cfg = make_config(
        task__name=str(_raising_task(tmp_path, raise_stmt)),
        train__steps=10,
        train__checkpoint_every=2,
        devices__use="cpu:0",
        telemetry__enabled=False,
    )
    result = Trainer(cfg).run()
    assert result.status == state and result.step == 3
    assert words in result.message and "the last checkpoint (step 2) is intact" in result.message
    assert status_of(result.run_dir)["state"] == state
    assert events(result.run_dir)[-1] == state
    assert torch.load(result.run_dir / "checkpoints/last.pt", weights_only=True)["step"] == 2


@pytest.mark.slow
def test_a_second_ctrl_c_during_a_step_aborts_and_records_aborted(tmp_path):
    task = tmp_path / "slow.py"
    task.write_text(SLOW.replace("{sleep}", "2.0"))
    runs = tmp_path / "runs"
    p = cli(
        "train",
        "--task",
        str(task),
        "--steps",
        "50",
        "--devices",
        "cpu:0",
        "--runs-dir",
        str(runs),
        "--set",
        "train.log_every=1",
        "--set",
        "train.checkpoint_every=1",
        "--set",
        "telemetry.enabled=false",
    )
    try:
        wait_for(lambda: has_train_records(runs), what="a first step")
        time.sleep(0.3)
        p.send_signal(signal.SIGINT)  # inside the next step, which runs 2 s
        time.sleep(0.3)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 130, out + err
    assert "Traceback" not in err
    run = only_run(runs)
    status = status_of(run)
    assert status["state"] == "aborted" and "aborted during step" in status["message"]
    assert events(run)[-1] == "aborted"
    assert torch.load(run / "checkpoints/last.pt", weights_only=True)["step"] == status["step"]


@pytest.mark.slow
def test_a_stop_during_set_up_ends_it_at_once_and_the_folder_says_so(tmp_path):
    """The folder comes before the task's code, so that a run stuck in its data() is seen and stopped:
    the first SIGTERM ends the set-up where it is ("stopped", exit 0), not after it."""
    task = tmp_path / "hangs.py"
    inside = tmp_path / "in-data"
    task.write_text(
        "import time\nfrom multilane.engine.tasks.builtin import LinearTask\n"
        "class Hangs(LinearTask):\n    name = 'hangs'\n"
        f"    def data(self):\n        open({str(inside)!r}, 'w').close()\n"
        "        while True:\n            time.sleep(0.05)\n"
    )
    p = cli("train", "--task", str(task), "--steps", "5", "--devices", "cpu:0", "--runs-dir", str(tmp_path / "runs"))
    try:
        wait_for(inside.exists, what="set-up to reach data()")
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=30)
    finally:
        p.kill()
    assert p.returncode == 0 and "Traceback" not in err, err
    (run,) = (tmp_path / "runs").iterdir()
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "stopped" and "loading data, before step 1" in status["message"], status


# -- one writer per run folder --------------------------------------------------------------------


@pytest.mark.slow
def test_a_run_folder_has_one_writer_and_a_killed_writer_leaves_no_stale_lock(tmp_path, make_config):
    cfg = make_config(task__name="linear", train__steps=2, devices__use="cpu:0", telemetry__enabled=False)
    run = Trainer(cfg).run().run_dir
    first = cli("train", "--resume", str(run), "--steps", "100000", "--set", "telemetry.enabled=false")
    try:
        wait_for(lambda: sum(r["kind"] == "train" for r in read_metrics(run)) > 3, what="the resume to run")
        second = subprocess.run(
            [*CLI, "train", "--resume", str(run), "--steps", "100000"], capture_output=True, text=True, timeout=120
        )
        assert second.returncode == 2
        assert second.stderr.strip() == (
            f"multilane: error: run {run} is in use by pid {first.pid}; one run writes to a folder at a time"
        )
        with pytest.raises(UserError, match=f"is in use by pid {first.pid}"):
            RunDir.open_existing(run)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(30)
    third = subprocess.run(
        [*CLI, "train", "--resume", str(run), "--steps", "3"], capture_output=True, text=True, timeout=120
    )
    assert third.returncode == 0, third.stderr  # the kernel released the dead writer's lock
    steps = [r["step"] for r in read_metrics(run) if r["kind"] == "train"]
    assert steps == sorted(steps) and steps[-1] == 3


def test_stale_temp_files_of_a_killed_write_go_at_the_next_resume(tmp_path, make_config):
    cfg = make_config(task__name="linear", train__steps=2, devices__use="cpu:0", telemetry__enabled=False)
    run = Trainer(cfg).run().run_dir
    stale = [run / "checkpoints/.last.pt.999999.tmp", run / ".status.json.999999.tmp", run / ".reserve"]
    for f in stale:
        f.write_bytes(b"\0" * 100_000)
    keep = run / "notes.tmp"
    keep.write_text("mine")
    assert Trainer(resume_from=run, overrides={"train.steps": 3}).run().status == "finished"
    assert not any(f.exists() for f in stale) and keep.read_text() == "mine"


# -- torn lines and short writes ----------------------------------------------------------------


def test_a_resume_after_a_torn_line_keeps_its_marker_and_every_step_once(tmp_path, make_config):
    cfg = make_config(
        task__name="linear", train__steps=6, devices__use="cpu:0", telemetry__enabled=False, train__checkpoint_every=3
    )
    run = Trainer(cfg).run().run_dir
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(b'{"kind":"train","step":7,"lo')  # what a short write (a full disk, a kill) leaves
    assert Trainer(resume_from=run, overrides={"train.steps": 9}).run().status == "finished"
    m = load_metrics(run)
    assert m.skipped == 1
    started = [r for r in m.records if r["kind"] == "event" and r["event"] == "started"]
    assert [s.get("resumed_from_step") for s in started] == [None, 6]
    assert [r["step"] for r in m.records if r["kind"] == "train"] == list(range(1, 10))


FSIZE_RUN = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
from multilane.engine.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_file_size_limit_hit_mid_line_fails_the_run_truthfully_and_resume_continues(tmp_path):
    # RLIMIT_FSIZE: a real short write then EFBIG from the kernel, without root.
    runs = tmp_path / "runs"
    limit = 300_000  # metrics.jsonl crosses it mid-line; every other file stays far under it
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            FSIZE_RUN.format(limit=limit),
            "train",
            "--task",
            "linear",
            "--steps",
            "100000",
            "--devices",
            "cpu:0",
            "--runs-dir",
            str(runs),
            "--set",
            "train.log_every=1",
            "--set",
            "train.checkpoint_every=50",
            "--set",
            "telemetry.enabled=false",
            "--set",
            "train.eval_every=0",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 1 and "Traceback" not in r.stderr
    run = only_run(runs)
    status = status_of(run)
    assert status["state"] == "failed"
    assert "no room to write metrics.jsonl" in status["message"] and "a file size limit" in status["message"]
    assert "the last checkpoint (step" in status["message"]
    assert (run / "error.txt").read_text().strip()
    assert os.path.getsize(run / "metrics.jsonl") == limit  # the short write filled it to the byte
    assert not list(run.rglob("*.tmp")) and not (run / ".reserve").exists()
    ck = torch.load(run / "checkpoints/last.pt", weights_only=True)["step"]
    assert ck > 0 and ck % 50 == 0
    resumed = subprocess.run(
        [*CLI, "train", "--resume", str(run), "--steps", str(ck + 5)], capture_output=True, text=True, timeout=300
    )
    assert resumed.returncode == 0, resumed.stderr
    steps = [x["step"] for x in read_metrics(run) if x["kind"] == "train"]
    assert steps == list(range(1, ck + 6))  # the marker after the torn line was seen: no step twice


@pytest.fixture
def small_disk(tmp_path):
    """A real 3 MiB file system (tmpfs): needs root and mount; skipped elsewhere."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_full_disk_at_a_checkpoint_fails_the_run_keeps_the_last_checkpoint_and_resume_works(small_disk, make_config):
    # mlp (width 256): a checkpoint of ~1.8 MB; the first fits, the second's temporary file does not.
    cfg = make_config(
        task__name="mlp",
        task__params={"samples": 512},
        train__steps=40,
        train__checkpoint_every=10,
        train__log_every=5,
        devices__use="cpu:0",
        telemetry__enabled=False,
        run__runs_dir=str(small_disk / "runs"),
    )
    result = Trainer(cfg).run()
    assert result.status == "failed"
    assert result.message.startswith(f"no room to write last.pt in {result.run_dir}: the disk is full (No space left")
    assert "the last checkpoint (step 10) is intact; free space, then resume" in result.message
    status = status_of(result.run_dir)
    assert status["state"] == "failed" and status["message"] == result.message
    assert events(result.run_dir)[-1] == "failed" and (result.run_dir / "error.txt").read_text().strip()
    assert torch.load(result.run_dir / "checkpoints/last.pt", weights_only=True)["step"] == 10
    assert not list(small_disk.rglob("*.tmp")) and not (result.run_dir / ".reserve").exists()
    subprocess.run(["mount", "-o", "remount,size=32m", str(small_disk)], check=True)  # space freed
    again = Trainer(resume_from=result.run_dir).run()
    assert again.status == "finished" and again.step == 40


@pytest.mark.slow
def test_the_default_checkpoint_cadence_is_wall_time_and_a_killed_run_can_resume(tmp_path):
    from multilane.engine.config import RunConfig

    assert RunConfig().train.checkpoint_minutes > 0 and RunConfig().train.checkpoint_every == 0
    runs = tmp_path / "runs"
    p = cli(
        "train",
        "--task",
        "linear",
        "--steps",
        "100000",
        "--devices",
        "cpu:0",
        "--runs-dir",
        str(runs),
        "--set",
        "train.checkpoint_minutes=0.02",
        "--set",
        "telemetry.enabled=false",
    )  # every 1.2 s
    try:
        wait_for(
            lambda: any((r / "checkpoints/last.pt").exists() for r in run_folders(runs)), what="a checkpoint by time"
        )
        time.sleep(1.5)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(30)
    run = only_run(runs)
    ck = torch.load(run / "checkpoints/last.pt", weights_only=True)["step"]
    assert ck > 0
    r = subprocess.run(
        [*CLI, "train", "--resume", str(run), "--steps", str(ck + 3)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr


# -- a resume runs only the task file its run recorded -----------------------------------------------

TASK = (
    "from multilane.engine.tasks.builtin import LinearTask\n"
    "open({marker!r}, 'a').write('{tag}')\n"
    "class Mine(LinearTask):\n    name = 'mine'\n"
)


@pytest.fixture
def task_run(tmp_path, make_config):
    marker = tmp_path / "ran"
    task = tmp_path / "mine.py"
    task.write_text(TASK.format(marker=str(marker), tag="a"))
    cfg = make_config(task__name=str(task), train__steps=2, devices__use="cpu:0", telemetry__enabled=False)
    run = Trainer(cfg).run().run_dir
    assert marker.read_text() == "a"
    marker.unlink()
    recorded = json.loads((run / "task_file.json").read_text())
    assert recorded["path"] == str(task.resolve()) and len(recorded["sha256"]) == 64
    return run, task, marker


def resume(run, *args, cwd=None):
    return subprocess.run(
        [*CLI, "train", "--resume", str(run), "--steps", "3", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )


@pytest.mark.slow
def test_a_resume_names_the_unchanged_task_file_then_runs_it(task_run):
    run, task, marker = task_run
    r = resume(run)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == f"running task file {task.resolve()}"
    assert marker.read_text() == "a"


@pytest.mark.slow
def test_a_resume_whose_task_file_changed_refuses_without_running_it(task_run):
    run, task, marker = task_run
    task.write_text(TASK.format(marker=str(marker), tag="b"))
    r = resume(run)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"the run's task file {task.resolve()} changed since the run started" in r.stderr
    assert "give it with --task" in r.stderr and not marker.exists()
    r = resume(run, "--task", str(task))  # the user says so: it runs, as it is now
    assert r.returncode == 0, r.stderr
    assert marker.read_text() == "b"


def test_a_resume_whose_task_file_moved_refuses(task_run, tmp_path):
    run, task, marker = task_run
    task.rename(tmp_path / "elsewhere.py")
    r = resume(run)
    assert r.returncode == 2 and "is gone or unreadable" in r.stderr and not marker.exists()


def test_a_planted_run_folder_naming_a_payload_never_runs_it(task_run, tmp_path):
    run, _, marker = task_run
    (run / "task_file.json").unlink()  # a folder made by hand, or before task files were recorded
    payload = tmp_path / "payload.py"
    payload.write_text(f"open({str(marker)!r}, 'w').write('pwned')\n")
    ck = torch.load(run / "checkpoints/last.pt", weights_only=True)
    ck["config"]["task"]["name"] = "payload.py"  # relative: it used to resolve against the cwd
    torch.save(ck, run / "checkpoints/last.pt")
    r = resume(run, cwd=tmp_path)
    assert r.returncode == 2 and "does not record its task file's hash" in r.stderr
    assert not marker.exists()
