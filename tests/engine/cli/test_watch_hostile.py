"""``multilane watch``, ``control`` and ``export`` on hostile or damaged run folders.
Every case is the real CLI in a subprocess: one line and an exit status, never a traceback, never a
wait for ever."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from helpers import CLI
from multilane.engine.run.trainer import Trainer

pytestmark = pytest.mark.timeout(300)

NAN_TASK = """
import torch
from multilane.engine.tasks.builtin import LinearTask

class NanAt3(LinearTask):
    name = "nan3"
    calls = 0

    def loss(self, output, target):
        NanAt3.calls += 1
        loss = super().loss(output, target)
        return loss * float("nan") if NanAt3.calls >= 3 else loss
"""


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A real finished run: eval records, telemetry, a status."""
    from multilane.engine.config import build_config

    runs = tmp_path_factory.mktemp("runs")
    cfg = build_config(
        {
            "task": {"name": "linear"},
            "devices": {"use": "cpu:0"},
            "train": {"steps": 6, "log_every": 1, "eval_every": 3},
            "telemetry": {"record_s": 0.2},
            "run": {"runs_dir": str(runs), "name": "w"},
        }
    )
    return Trainer(cfg).run().run_dir


@pytest.fixture
def run(finished, tmp_path) -> Path:
    """A copy of the finished run, to damage."""
    return Path(shutil.copytree(finished, tmp_path / "run"))


def watch(*args: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "watch", *args], capture_output=True, text=True, timeout=timeout, **kw)


def assert_one_line_error(out: subprocess.CompletedProcess, *words: str) -> None:
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("multilane: error: "), out.stderr
    for w in words:
        assert w in lines[0], lines[0]


@pytest.mark.slow
def test_watch_shows_a_real_run_that_diverged_on_a_nan_loss(tmp_path):
    task = tmp_path / "nan.py"
    task.write_text(NAN_TASK)
    runs = tmp_path / "runs"
    args = ["--task", str(task), "--devices", "cpu:0", "--steps", "20", "--runs-dir", str(runs)]
    trained = subprocess.run([*CLI, "train", *args, "--set", "train.log_every=1"], capture_output=True, timeout=120)
    assert trained.returncode == 3, trained.stderr  # EXIT_DIVERGED: neither a Stop (0) nor a failure (1)
    (run,) = list(runs.iterdir())
    assert b'"loss":null' in (run / "metrics.jsonl").read_bytes()
    out = watch(str(run))
    assert "Traceback" not in out.stderr, out.stderr
    assert out.returncode == 3, out.stdout
    assert out.stdout.strip().splitlines()[-1].startswith("diverged: step 3"), out.stdout
    assert "loss nan" in out.stdout


DAMAGES = {
    "missing loss": '{"kind":"train","step":5}',
    "string loss": '{"kind":"train","step":5,"loss":"abc"}',
    "null val_loss": '{"kind":"eval","step":5,"val_loss":null}',
    "step abc": '{"kind":"train","step":"abc","loss":1.0}',
    "devices as a list": '{"kind":"telemetry","wall_time":1.0,"devices":[1,2]}',
    "string busy_pct": '{"kind":"telemetry","wall_time":1.0,"devices":{"cpu:0":{"busy_pct":"x"}}}',
    "null memory": '{"kind":"telemetry","wall_time":1.0,"devices":{"cpu:0":{"mem_used_mb":null}}}',
    "deep line": "[" * 100_000 + "]" * 100_000,
    "NaN literals": '{"kind":"train","step":5,"loss":NaN,"samples_per_s":Infinity}',
    "warning without a message": '{"kind":"event","event":"warning","step":5}',
    "numeric sample": '{"kind":"eval","step":5,"val_loss":1.0,"sample":5}',
    "total_steps a string": '{"kind":"event","event":"started","step":0,"total_steps":"x"}',
}


@pytest.mark.slow
@pytest.mark.parametrize("damage", list(DAMAGES), ids=list(DAMAGES))
def test_watch_survives_a_damaged_metrics_line(run, damage):
    with open(run / "metrics.jsonl", "a") as f:
        f.write(DAMAGES[damage] + "\n")
    out = watch(str(run))
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    assert out.stdout.strip().splitlines()[-1].startswith("finished: step 6/6")


@pytest.mark.slow
@pytest.mark.parametrize("step", ['"abc"', "NaN", "-1", "1e400", "[1]"])
def test_watch_survives_a_damaged_status_step(run, step):
    text = (run / "status.json").read_text()
    (run / "status.json").write_text(text.replace('"step": 6', f'"step": {step}'))
    out = watch(str(run))
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert out.stdout.strip().splitlines()[-1].startswith("finished: step 6")


@pytest.mark.parametrize("interval", ["nan", "-1", "inf", "1e308", "0", "abc"])
def test_watch_refuses_a_bad_interval(run, interval):
    out = watch(str(run), "--interval", interval)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.count("\n") == 1 and "--interval" in out.stderr


@pytest.mark.slow
@pytest.mark.parametrize("name", ["metrics.jsonl", "status.json"])
@pytest.mark.parametrize("what", ["fifo", "folder"])
def test_watch_refuses_a_run_file_that_is_not_a_file(run, name, what):
    (run / name).unlink()
    if what == "fifo":
        os.mkfifo(run / name)
    else:
        (run / name).mkdir()
    out = watch(str(run), timeout=60)  # a FIFO used to block for ever
    assert_one_line_error(out, name, "FIFO" if what == "fifo" else "folder")


@pytest.mark.slow
def test_watch_of_the_runs_folder_names_it(run):
    out = watch(str(run.parent), timeout=60)
    assert_one_line_error(out, "is a runs folder, not a run", str(run))
    empty = run.parent / "empty"
    empty.mkdir()
    assert_one_line_error(watch(str(empty)), "is not a run folder")


def _running(run: Path, lock_text: str) -> None:
    status = json.loads((run / "status.json").read_text()) | {"state": "running"}
    (run / "status.json").write_text(json.dumps(status))
    (run / ".lock").write_text(lock_text)


@pytest.mark.slow
def test_watch_ends_when_the_writers_pid_was_reused_by_a_live_process(run):
    other = subprocess.Popen(["sleep", "300"])  # an unrelated live process with the writer's old pid
    try:
        _running(run, f"{other.pid}\n{socket.gethostname()}\n")
        out = watch(str(run), timeout=60)
    finally:
        other.kill()
        other.wait()
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert "no longer holds the run's lock" in out.stdout


@pytest.mark.slow
def test_watch_ends_on_a_status_whose_state_is_a_list(run):
    _running(run, f"{os.getpid()}\n{socket.gethostname()}\n")
    (run / "status.json").write_text(json.dumps({"state": ["running"], "step": 6}))
    out = watch(str(run), timeout=60)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr


def test_control_refuses_a_control_file_that_is_a_folder(run):
    (run / "control.json").mkdir()
    out = subprocess.run([*CLI, "control", str(run), "stop"], capture_output=True, text=True, timeout=60)
    assert_one_line_error(out, "control.json", "is a folder")


def test_control_in_a_read_only_run_folder_is_one_line(run, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["mount", "--bind", str(run), str(ro)], capture_output=True).returncode:
        pytest.skip("needs a bind mount (root)")
    try:
        if subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], capture_output=True).returncode:
            pytest.skip("cannot remount read-only")
        out = subprocess.run([*CLI, "control", str(ro), "pause"], capture_output=True, text=True, timeout=60)
    finally:
        subprocess.run(["umount", str(ro)], check=True)
    assert_one_line_error(out, "cannot write", "control.json", "Read-only file system")


@pytest.mark.slow
def test_export_of_nan_and_infinity_literals_draws_the_rest(run, tmp_path):
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"kind":"train","step":7,"wall_time":NaN,"loss":NaN,"samples_per_s":Infinity}\n')
        f.write('{"kind":"eval","step":7,"val_loss":-Infinity,"metrics":{"mse":NaN}}\n')
    out = subprocess.run(
        [*CLI, "export", str(run), "--out", str(tmp_path / "out"), "--format", "png"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert list((tmp_path / "out").glob("*.png"))


def _limited(gib: int):
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (gib << 30, gib << 30))

    return limit


@pytest.mark.slow
def test_watch_and_export_stream_a_5_gib_sparse_metrics_file_under_a_4_gib_limit(run, tmp_path):
    metrics = run / "metrics.jsonl"
    good = metrics.read_bytes()
    with open(metrics, "r+b") as f:  # larger than all the address space the commands may have (4 GiB)
        f.truncate(5 << 30)  # 5 GiB of NULs on no disk: one "line" with no newline
        f.seek(5 << 30)
        f.write(b"\n" + good)
    out = watch(str(run), timeout=240, preexec_fn=_limited(4))
    assert out.returncode == 0, out.stderr
    assert "MemoryError" not in out.stderr and "Traceback" not in out.stderr
    assert out.stdout.strip().splitlines()[-1].startswith("finished: step 6/6")
    assert "1 unreadable line skipped" in out.stderr
    exp = subprocess.run(
        [*CLI, "export", str(run), "--out", str(tmp_path / "out"), "--format", "csv"],
        capture_output=True,
        text=True,
        timeout=240,
        preexec_fn=_limited(4),
    )
    assert exp.returncode == 0, exp.stderr
    assert "1 unreadable line skipped" in exp.stderr


@pytest.mark.parametrize("delay", [0.5, 1.0, 2.0])
def test_ctrl_c_while_the_cli_starts_is_one_line(run, delay):
    from multilane.engine.rundir.run_lock import lock_run_folder

    _running(run, "")
    lock = lock_run_folder(run)  # a live writer: watch follows until Ctrl+C
    try:
        # The delay counts from the end of the interpreter's own start (its ``site`` import, reported by
        # -X importtime), not from the fork: on a loaded machine Python itself may take over a second to
        # start, and a Ctrl+C inside CPython's start-up is CPython's traceback, before any of our code.
        cmd = [CLI[0], "-X", "importtime", *CLI[1:], "watch", str(run)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for line in proc.stderr:
            if line.rstrip().endswith("| site"):
                break
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # a Ctrl+C that a library's import swallowed: the user presses again
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=60)
    finally:
        lock.release(force=True)
    assert "Traceback" not in err, err
    # 130 while it starts ("multilane: interrupted"), 0 once it follows; -2 before Python's own handler
    assert proc.returncode in (0, 130, -signal.SIGINT)
