"""One way of saying each thing: the error prefix of every subcommand, the CPU lanes, a runs folder
that cannot be written (said before any set-up), ``watch`` off a terminal, the install hint."""

import itertools
import json
import os
import subprocess
import sys
import time

import pytest
from helpers import CLI, start_long_cli_run
from multilane.engine.rundir.control_file import write_control


def multilane(*args, timeout=300, **kw):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, **kw)


@pytest.mark.slow
def test_every_subcommand_says_multilane_error_like_the_rest(tmp_path):
    for args in (
        ("train", "--bogus"),
        ("train", "--steps", "many"),
        ("watch",),
        ("control", str(tmp_path), "jump"),
        ("devices", "--bogus"),
        ("export",),
        ("--bogus",),
    ):
        r = multilane(*args)
        assert r.returncode == 2, args
        assert r.stderr.startswith("multilane: error: "), (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = multilane("train", "--steps", "many")  # found by the subcommand's parser: named after the prefix
    assert r.stderr.startswith("multilane: error: train: argument --steps: 'many' is not a whole number"), r.stderr


@pytest.mark.slow
def test_devices_lists_one_lane_per_usable_core_the_apps_rule(tmp_path):
    from multilane.engine.telemetry.devices import cpu_lane_count

    cores = len(os.sched_getaffinity(0))
    lanes = max(2, min(8, cores))
    assert cpu_lane_count() == lanes
    (cpu,) = [d for d in json.loads(multilane("devices", "--json").stdout) if d["kind"] == "cpu"]
    assert cpu["lanes"] == lanes and cpu["cores"] == cores
    table = multilane("devices").stdout
    assert f"cpu:0–cpu:{lanes - 1}" in table and f"{lanes} CPU lanes on {cores} cores" in table
    one = subprocess.run(["taskset", "-c", "0", *CLI, "devices", "--json"], capture_output=True, text=True, timeout=300)
    (cpu,) = [d for d in json.loads(one.stdout) if d["kind"] == "cpu"]
    assert cpu["cores"] == 1 and cpu["lanes"] == 2  # a container's share, not the machine's


@pytest.mark.slow
def test_an_unwritable_runs_folder_is_refused_before_the_tasks_set_up(tmp_path):
    marker = tmp_path / "data-was-built"
    task = tmp_path / "slow_setup.py"
    task.write_text(
        "from pathlib import Path\n"
        "from multilane.engine.tasks.builtin import LinearTask\n"
        "class SlowSetup(LinearTask):\n"
        "    name = 'slow_setup'\n"
        "    def data(self):\n"
        f"        Path({str(marker)!r}).write_text('set-up ran')\n"
        "        return super().data()\n"
    )
    (tmp_path / "a-file").write_text("x")
    r = multilane("train", "--task", str(task), "--steps", "3", "--runs-dir", str(tmp_path / "a-file" / "runs"))
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("multilane: error: runs folder") and "not writable" in r.stderr
    assert not marker.exists()


@pytest.mark.slow
def test_watch_off_a_terminal_prints_a_line_when_the_run_moves_not_every_second(tmp_path):
    runs = tmp_path / "runs"
    # telemetry every 0.2 s, but no step logged for a long time: nothing new for a reader of the log
    proc = start_long_cli_run(
        runs, "train.log_every=100000", "train.eval_every=0", "telemetry.record_s=0.2", stderr=subprocess.DEVNULL
    )

    def telemetry_records() -> int:
        return (run_dir / "metrics.jsonl").read_text().count('"kind":"telemetry"')

    try:
        deadline = time.monotonic() + 90
        while not list(runs.glob("*/metrics.jsonl")) and time.monotonic() < deadline:
            time.sleep(0.2)
        (run_dir,) = [p.parent for p in runs.glob("*/metrics.jsonl")]
        watch = subprocess.Popen([*CLI, "watch", str(run_dir)], stdout=subprocess.PIPE, text=True)
        first = watch.stdout.readline()  # watch is up and following
        seen = telemetry_records()
        deadline = time.monotonic() + 120
        while telemetry_records() < seen + 10 and time.monotonic() < deadline:
            time.sleep(0.2)
        write_control(run_dir, "stop")
        out, _ = watch.communicate(timeout=90)
        assert proc.wait(timeout=90) == 0
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert telemetry_records() >= seen + 10
    lines = [first.strip(), *out.strip().splitlines()]
    progress = [line.split(" · cpu:")[0] for line in lines]  # the line without its telemetry readings
    assert all(a != b for a, b in itertools.pairwise(progress)), lines
    assert lines[-1].startswith("stopped: step")


def test_the_imagefolder_hint_names_the_installed_torch_in_the_same_pip_call():
    code = (
        "import sys; sys.modules['torchvision'] = None\n"  # torchvision not installed
        "from multilane.engine.tasks.imagefolder import torchvision_or_hint\n"
        "from multilane.engine.errors import UserError\n"
        "try:\n    torchvision_or_hint()\nexcept UserError as e:\n    print(e)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    import torch

    version = torch.__version__.split("+")[0]
    assert f'pip install "torch=={version}" -e ".[vision]"' in r.stdout, r.stdout
