"""An fsdp run stops on SIGTERM with a sharded checkpoint at the step every
rank stopped at; SIGKILL in the middle of a sharded save leaves the previous checkpoint whole.

An fsdp run saves at every step; the test watches its checkpoints folder and kills every process of
the run (launcher and ranks, SIGKILL) the moment a save's temporary folder appears, i.e. while the
ranks are writing their shards. ``last.pt`` must then name a whole folder (the previous save's), the
model must read back from it, and the run must resume from it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import psutil
import pytest
import torch
from fsdp_helpers import run_dirs
from helpers import CLI
from multilane.engine.fsdp.sharded import read_model_state
from multilane.engine.run.trainer import Trainer

pytestmark = pytest.mark.timeout(300)


def long_run(runs, *settings: str) -> subprocess.Popen:
    args = [*CLI, "train", "--strategy", "fsdp", "--task", "mlp", "--devices", "cpu:0,cpu:1", "--runs-dir", str(runs)]
    args += ["--steps", "100000", "--set", "task.params.width=384", "--set", "task.params.samples=512"]
    for s in ("train.log_every=1", "train.eval_every=0", "telemetry.enabled=false", *settings):
        args += ["--set", s]
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def kill_tree(p: subprocess.Popen) -> list[int]:
    try:
        root = psutil.Process(p.pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:  # it has ended (and its ranks with it: the agent stops them first)
        return []
    for proc in procs:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass
    return [q.pid for q in procs]


@pytest.mark.slow
def test_sigkill_during_a_sharded_save_leaves_the_previous_checkpoint_whole(tmp_path):
    runs = tmp_path / "runs"
    p = long_run(runs, "train.checkpoint_every=1")
    caught = None
    try:
        end = time.monotonic() + 240
        while caught is None and time.monotonic() < end and p.poll() is None:
            for run in run_dirs(runs):
                ck = run / "checkpoints"
                names = os.listdir(ck) if ck.is_dir() else []
                saving = [n for n in names if n.startswith(".sharded-") and not n.startswith(".sharded-1-")]
                if saving and "last.pt" in names:
                    caught = (run, saving[0])
            time.sleep(0.001)
    finally:
        pids = kill_tree(p)
    p.communicate()
    assert caught is not None, "no save was seen under way"
    run, _ = caught
    end = time.monotonic() + 30
    while any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids):
        assert time.monotonic() < end, "the run's processes outlived SIGKILL"
        time.sleep(0.05)
    ck = torch.load(run / "checkpoints" / "last.pt", weights_only=True)
    # The previous save's folder (or, had the kill landed after the rename of last.pt, the new one): whole.
    assert (run / "checkpoints" / ck["sharded"] / ".metadata").is_file()
    state = read_model_state(run)
    assert state["0.weight"].shape == (384, 64)
    step = int(ck["step"])
    result = Trainer(
        resume_from=run, overrides={"train.steps": step + 1, "devices.strategy": "replicate", "devices.use": "cpu:0"}
    ).run()
    assert result.status == "finished", result.message
    # A plain save (one process) names no folder: the sharded ones, and the killed save's, are gone.
    assert os.listdir(run / "checkpoints") == ["last.pt"]


@pytest.mark.slow
def test_sigterm_stops_every_rank_at_one_step_with_a_sharded_checkpoint_there(tmp_path):
    import json

    from multilane.engine.rundir.runlog import read_metrics

    runs = tmp_path / "runs"
    p = long_run(runs)
    try:
        end = time.monotonic() + 240
        while time.monotonic() < end and p.poll() is None:
            found = run_dirs(runs)
            if found and len([r for r in read_metrics(found[0]) if r["kind"] == "train"]) >= 3:
                break
            time.sleep(0.1)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=120)
    finally:
        kill_tree(p)
    assert p.returncode == 0, err[-3000:]
    (run,) = run_dirs(runs)
    status = json.loads((run / "status.json").read_text())
    ck = torch.load(run / "checkpoints" / "last.pt", weights_only=True)
    assert status["state"] == "stopped" and ck["step"] == status["step"] >= 3, status
    assert [n for n in os.listdir(run / "checkpoints") if n != "last.pt"] == [ck["sharded"]]
    assert len(ck["lane_rng"]["lanes"]) == 2  # every rank's random stream
