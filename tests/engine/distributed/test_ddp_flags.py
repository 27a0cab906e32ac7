"""ddp's flags are checked before anything is made, long values are cut in an
error line, and a SIGTERM to the launcher leaves no torch log line on stderr. Real CLI, real ranks."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest
from helpers import CLI

pytestmark = pytest.mark.timeout(300)


def train(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "train", *args], capture_output=True, text=True, timeout=timeout)


def assert_one_line(out: subprocess.CompletedProcess, *words: str) -> None:
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0], out.stderr
    for w in words:
        assert w in lines[0], lines[0]


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0", "1e308"])
def test_a_bad_rendezvous_timeout_is_one_line_and_makes_no_folder(tmp_path, value):
    runs = tmp_path / "runs"
    out = train("--strategy", "ddp", "--devices", "cpu:0,cpu:1", "--runs-dir", str(runs), "--rdzv-timeout", value)
    assert_one_line(out, "--rdzv-timeout", "1 to 86400")
    assert not runs.exists() or not list(runs.iterdir())


def test_a_5000_character_rendezvous_id_is_one_short_line(tmp_path):
    runs = tmp_path / "runs"
    out = train("--strategy", "ddp", "--devices", "cpu:0,cpu:1", "--runs-dir", str(runs), "--rdzv-id", "a" * 5000)
    assert_one_line(out, "--rdzv-id", "5,000 characters")
    assert len(out.stderr) < 300
    assert not runs.exists() or not list(runs.iterdir())


def test_a_charlm_temperature_that_would_fail_at_the_first_evaluation_is_refused(tmp_path):
    out = train("--task", "charlm", "--runs-dir", str(tmp_path / "runs"), "--set", "task.params.temperature=1e-300")
    assert_one_line(out, "temperature", "0.01")
    assert not (tmp_path / "runs").exists()


def test_a_500000_character_path_gives_a_line_of_readable_length(tmp_path):
    config = tmp_path / "long.json"
    config.write_text(json.dumps({"run": {"runs_dir": str(tmp_path / ("b" * 500_000))}}))
    out = train("--config", str(config), "--devices", "cpu:0")
    assert_one_line(out, "run.runs_dir", "a name in the path is 500,000 bytes long")  # refused up front
    assert len(out.stderr) < 400


@pytest.mark.slow
def test_sigterm_to_a_ddp_launcher_leaves_no_torch_log_line(tmp_path):
    runs = tmp_path / "runs"
    args = [*CLI, "train", "--strategy", "ddp", "--task", "mlp", "--devices", "cpu:0,cpu:1"]
    args += ["--steps", "100000", "--runs-dir", str(runs), "--set", "telemetry.enabled=false"]
    launcher = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 180
        while time.time() < deadline and not any(
            b'"kind":"train"' in p.read_bytes() for p in runs.glob("*/metrics.jsonl")
        ):
            time.sleep(0.2)
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=180)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert "death signal" not in err, err
    assert "Traceback" not in err, err
