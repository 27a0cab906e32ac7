"""Following a run another process writes: incremental reads, the control file, ``multilane watch``."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from helpers import CLI, start_long_cli_run
from multilane.engine.errors import UserError
from multilane.engine.run.control import RunControl
from multilane.engine.rundir.control_file import ControlFile, write_control
from multilane.engine.rundir.follow import MetricsTail, RunFollower


def test_the_tail_parses_only_appended_whole_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    assert tail.read() == []  # no file yet
    with open(path, "wb") as f:
        f.write(b'{"kind":"train","step":1}\n{"kind":"train","step":2}\n{"kind":"tr')
    assert [r["step"] for r in tail.read()] == [1, 2]
    offset = tail.offset
    assert offset == path.stat().st_size
    assert tail.read() == []  # nothing new: nothing parsed
    with open(path, "ab") as f:
        f.write(b'ain","step":3}\n')
    assert [r["step"] for r in tail.read()] == [3]  # the torn line, completed
    assert tail.offset == path.stat().st_size
    path.write_bytes(b'{"kind":"train","step":9}\n')  # a new file (shorter): start over
    assert [r["step"] for r in tail.read()] == [9]


def test_the_follower_reports_status_only_when_it_changes(tmp_path):
    (tmp_path / "status.json").write_text(json.dumps({"state": "running", "step": 1}))
    follower = RunFollower(tmp_path)
    assert follower.poll().status == {"state": "running", "step": 1}
    assert follower.poll().status is None
    tmp = tmp_path / ".s.tmp"
    tmp.write_text(json.dumps({"state": "finished", "step": 5}))
    os.replace(tmp, tmp_path / "status.json")
    assert follower.poll().status["state"] == "finished"
    assert follower.done


def test_the_control_file_applies_new_commands_only(tmp_path):
    (tmp_path / "status.json").write_text('{"state": "running"}')  # a run folder: control acts only on one
    write_control(tmp_path, "stop")  # written before the run: not for it
    cf, control = ControlFile(tmp_path, every_s=0.0), RunControl()
    assert cf.apply(control) is None and not control.stop_requested
    write_control(tmp_path, "pause")
    assert cf.apply(control) == "pause" and control.pause_requested
    assert cf.apply(control) is None  # read once
    write_control(tmp_path, "resume")
    assert cf.apply(control) == "resume" and not control.pause_requested
    write_control(tmp_path, "stop")
    assert cf.apply(control) == "stop" and control.stop_requested
    with pytest.raises(UserError, match="unknown command"):
        write_control(tmp_path, "explode")


@pytest.mark.slow
def test_watch_follows_a_cli_run_and_the_control_file_stops_it(tmp_path):
    runs = tmp_path / "runs"
    run = start_long_cli_run(runs, "train.log_every=5", "train.eval_every=0", stderr=subprocess.DEVNULL)
    watcher = None
    try:
        t_end = time.monotonic() + 90
        while not list(runs.glob("*/metrics.jsonl")) and time.monotonic() < t_end:
            time.sleep(0.1)
        (run_dir,) = [p.parent for p in runs.glob("*/metrics.jsonl")]
        watcher = subprocess.Popen(
            [*CLI, "watch", str(run_dir), "--interval", "0.2"], stdout=subprocess.PIPE, text=True
        )
        steps = []
        while len(set(steps)) < 3 and time.monotonic() < t_end:
            line = watcher.stdout.readline()
            assert line, "watch ended early"
            if line.startswith("running: step "):
                steps.append(int(line.split()[2].split("/")[0]))
        assert len(set(steps)) >= 3 and steps == sorted(steps), steps
        r = subprocess.run([*CLI, "control", str(run_dir), "stop"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert run.wait(timeout=60) == 0
        rest, _ = watcher.communicate(timeout=60)
    finally:
        run.kill()
        if watcher is not None:
            watcher.kill()
    assert watcher.returncode == 0
    last = rest.strip().splitlines()[-1]
    status = json.loads((Path(run_dir) / "status.json").read_text())
    assert status["state"] == "stopped"
    assert last.startswith(f"stopped: step {status['step']}/100000"), last
