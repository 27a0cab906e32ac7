"""The ``multilane`` command, run as a real subprocess."""

import glob
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import CLI, run_folders, start_long_cli_run
from multilane.engine.rundir.runlog import read_metrics


def multilane(*args, timeout=300):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def only_run(runs: Path) -> Path:
    (run,) = list(runs.iterdir())
    return run


@pytest.mark.slow
def test_digits_on_two_cpu_lanes_reaches_90_percent_and_leaves_a_complete_run_directory(tmp_path):
    r = multilane(
        "train",
        "--task",
        "digits",
        "--devices",
        "cpu:0,cpu:1",
        "--epochs",
        "5",
        "--runs-dir",
        str(tmp_path),
        "--name",
        "digits",
    )
    assert r.returncode == 0, r.stderr
    run = only_run(tmp_path)
    assert run.name.endswith("-digits")
    assert {"config.json", "environment.json", "metrics.jsonl", "status.json"} <= {p.name for p in run.iterdir()}
    assert json.loads((run / "status.json").read_text())["state"] == "finished"
    env = json.loads((run / "environment.json").read_text())
    assert env["torch"] == torch.__version__ and env["devices"]
    records = read_metrics(run)
    evals = [r for r in records if r["kind"] == "eval"]
    assert evals[-1]["metrics"]["accuracy"] >= 0.90
    train = [r for r in records if r["kind"] == "train"]
    assert all({"step", "wall_time", "loss", "device_loss"} <= set(t) for t in train)
    assert set(train[-1]["device_loss"]) == {"cpu:0", "cpu:1"}
    ck = torch.load(run / "checkpoints/last.pt", weights_only=True)
    assert {"model", "optimizer", "step", "config"} <= set(ck) and ck["config"]["devices"]["use"] == "cpu:0,cpu:1"
    assert "validation loss" in r.stdout and str(run) in r.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,words",
    [
        (["--devices", "tpu:0"], "'tpu:0' is not a device"),
        (["--devices", "cuda:0"], "no CUDA GPU"),
        (["--lr", "-1"], "optim.lr = -1.0"),
        (["--batch-size", "zero"], "'zero' is not a whole number"),
        (["--optimizer", "rmsprop"], "optim.name"),
        (["--strategy", "ring"], 'devices.strategy = "ring"'),
        (["--task", "nope"], "unknown task 'nope'"),
        (["--epochs", "2", "--steps", "3"], "not allowed with argument"),
        (["--config", "missing.toml"], "no such config file"),
        (["--resume", "/nonexistent/run"], "is not a run folder"),
        (["--set", "train.colour=1"], "train.colour: unknown key"),
        (["--set", "nonsense"], "expected KEY=VALUE"),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path, args, words):
    r = multilane("train", "--runs-dir", str(tmp_path), *args)
    assert r.returncode == 2
    assert words in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "Traceback" not in r.stderr
    assert not list(tmp_path.iterdir())  # nothing written for a refused run


def test_devices_lists_cpu_lanes_as_json():
    r = multilane("devices", "--json")
    assert r.returncode == 0
    devices = json.loads(r.stdout)
    assert devices[-1]["kind"] == "cpu" and devices[-1]["cores"] >= 1


@pytest.mark.cold_start
@pytest.mark.skipif(
    any(glob.glob(p) for p in ("/dev/nvidia[0-9]*", "/dev/kfd", "/dev/dxg")), reason="a GPU's device node is here"
)
def test_devices_on_a_machine_without_a_gpu_node_lists_the_cpu_without_importing_torch():
    # An SSH host's `devices --json` (the app's host picker, every remote run's start): no GPU can be
    # reached without a device node, so torch's 2 CPU-seconds of import are not paid to learn that.
    r = subprocess.run(
        [sys.executable, "-X", "importtime", *CLI[1:], "devices", "--json"], capture_output=True, text=True
    )
    assert r.returncode == 0 and [row["kind"] for row in json.loads(r.stdout)] == ["cpu"], r.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert "multilane.engine.telemetry.devices" in imported and "torch" not in imported


@pytest.mark.slow
def test_config_file_and_flags_combine_with_flags_winning(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[task]\nname = "linear"\n[train]\nsteps = 50\n[optim]\nlr = 0.5\nname = "sgd"\n')
    r = multilane(
        "train", "--config", str(cfg), "--steps", "4", "--strategy", "persistent", "--runs-dir", str(tmp_path / "runs")
    )
    assert r.returncode == 0, r.stderr
    saved = json.loads((only_run(tmp_path / "runs") / "config.json").read_text())
    assert saved["train"]["steps"] == 4 and saved["optim"]["lr"] == 0.5 and saved["task"]["name"] == "linear"
    assert saved["devices"]["strategy"] == "persistent"


@pytest.mark.slow
def test_resume_from_the_command_line_continues_the_run(tmp_path):
    assert multilane("train", "--task", "linear", "--steps", "5", "--runs-dir", str(tmp_path)).returncode == 0
    run = only_run(tmp_path)
    r = multilane("train", "--resume", str(run), "--steps", "9")
    assert r.returncode == 0, r.stderr
    assert "step 9/9" in r.stdout
    assert [x["step"] for x in read_metrics(run) if x["kind"] == "train"][-1] == 9


@pytest.mark.slow
def test_ctrl_c_stops_gracefully_with_a_checkpoint(tmp_path):
    p = start_long_cli_run(tmp_path, "train.log_every=5", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            runs = run_folders(tmp_path)
            if runs and any(r["kind"] == "train" for r in read_metrics(runs[0])):
                break
            time.sleep(0.2)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 0, err
    run = only_run(tmp_path)
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "stopped"
    ck = torch.load(run / "checkpoints/last.pt", weights_only=True)
    assert ck["step"] == status["step"] > 0
    assert "stopped: step" in out
