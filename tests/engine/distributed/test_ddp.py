"""The ddp strategy: ranks launched through torch's elastic launcher, Gloo on CPU, 127.0.0.1 only.

Every run here is real: real processes, real collectives, real files.
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch
from helpers import CLI, TASK_FILES, TESTS, max_rel_diff
from multilane.engine.config import build_config
from multilane.engine.run.trainer import Trainer
from multilane.engine.rundir.runlog import read_metrics
from multilane.engine.tasks import make_task

HELPERS = str(TESTS / "helpers.py")

pytestmark = pytest.mark.timeout(240)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_dirs(runs: Path) -> list[Path]:
    return sorted(p for p in runs.glob("*") if p.is_dir())


def train_args(runs: Path, *extra: str, task: str = HELPERS, devices: str = "cpu:0,cpu:1") -> list[str]:
    return [*CLI, "train", "--strategy", "ddp", "--task", task, "--devices", devices, "--runs-dir", str(runs), *extra]


def float64_settings(steps: int, task: str = HELPERS) -> dict:
    # 96 samples, 19 held out: 77 to train on in batches of 19, so every 5th batch holds one sample
    # (rank 1 gets none) and the others split 10/9 (uneven shards); two micro-batches per step.
    return {
        "task": {"name": task},
        "data": {"batch_size": 19, "val_fraction": 0.2},
        "optim": {"name": "adam", "lr": 0.01},
        "train": {"steps": steps, "grad_accum": 2, "log_every": 1, "eval_every": 2, "seed": 5},
        "telemetry": {"enabled": False},
    }


def reference(tmp_path: Path, steps: int, task: str = HELPERS) -> tuple[Trainer, list[dict]]:
    """The single-process engine on one device: plain full-batch training."""
    cfg = float64_settings(steps, task)
    cfg["devices"] = {"use": "cpu:0"}
    cfg["run"] = {"runs_dir": str(tmp_path / "ref"), "name": f"ref{steps}"}
    trainer = Trainer(build_config(cfg), task=make_task(task))
    result = trainer.run()
    assert result.status == "finished"
    return trainer, read_metrics(result.run_dir)


def model_from(run_dir: Path, task: str = HELPERS) -> torch.nn.Module:
    ck = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    model = make_task(task).build_model()
    model.load_state_dict(ck["model"])
    return model


def assert_same_run(ddp: list[dict], ref: list[dict], tol: float = 1e-10) -> None:
    train = [r for r in ddp if r["kind"] == "train"]
    ref_train = [r for r in ref if r["kind"] == "train"]
    assert [r["step"] for r in train] == [r["step"] for r in ref_train]
    for a, b in zip(train, ref_train, strict=True):
        assert abs(a["loss"] - b["loss"]) <= tol * abs(b["loss"]), (a, b)
    evals = {r["step"]: r for r in ddp if r["kind"] == "eval"}
    ref_evals = [r for r in ref if r["kind"] == "eval"]
    assert ref_evals
    for b in ref_evals:
        assert evals[b["step"]]["val_loss"] == pytest.approx(b["val_loss"], rel=tol)


@pytest.mark.slow
def test_two_gloo_ranks_equal_full_batch_training_and_resume_on_one_rank(tmp_path):
    runs = tmp_path / "runs"
    cfg_path = tmp_path / "ddp.json"
    cfg = float64_settings(3)
    cfg["run"] = {"runs_dir": str(runs), "name": "ddp"}
    cfg_path.write_text(json.dumps(cfg))
    r = subprocess.run(
        [*CLI, "train", "--strategy", "ddp", "--config", str(cfg_path), "--devices", "cpu:0,cpu:1"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (run,) = run_dirs(runs)
    records = read_metrics(run)
    ref3, ref_records = reference(tmp_path, 3)
    assert max_rel_diff(model_from(run), ref3.model) <= 1e-10
    assert_same_run(records, ref_records)
    keys = set(next(r for r in records if r["kind"] == "train" and r["step"] == 1)["device_loss"])
    host = socket.gethostname()
    assert keys == {f"{host}/rank0/cpu:0", f"{host}/rank1/cpu:1"}
    assert json.loads((run / "status.json").read_text())["state"] == "finished"

    # Resume the two-rank run on one rank: the same global batches, so still full-batch training.
    r = subprocess.run(
        [*CLI, "train", "--resume", str(run), "--steps", "6", "--devices", "cpu:0"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    ref6, ref6_records = reference(tmp_path, 6)
    assert max_rel_diff(model_from(run), ref6.model) <= 1e-10
    assert_same_run(read_metrics(run), ref6_records)


PADDED = str(TASK_FILES / "padded_tokens.py")


@pytest.mark.slow
def test_a_token_mean_loss_with_padding_is_weighted_by_tokens_across_ranks(tmp_path):
    # loss_weight (non-padding tokens) decides each rank's share; some shards are all padding.
    runs = tmp_path / "runs"
    cfg = float64_settings(4, PADDED)  # 72 sequences to train on: batches of 19 (10/9 per rank) and 15
    cfg["run"] = {"runs_dir": str(runs), "name": "ddp"}
    path = tmp_path / "ddp.json"
    path.write_text(json.dumps(cfg))
    r = subprocess.run(
        [*CLI, "train", "--strategy", "ddp", "--config", str(path), "--devices", "cpu:0,cpu:1"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (run,) = run_dirs(runs)
    ref, ref_records = reference(tmp_path, 4, PADDED)
    assert max_rel_diff(model_from(run, PADDED), ref.model) <= 1e-10
    assert_same_run(read_metrics(run), ref_records)


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None):
    """``predicate()``'s first true value within ``timeout``; with ``proc``, a process that ends first
    fails at once with its own words (not a wait to the timeout that says nothing of why)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"{what}: the process ended first (exit {proc.returncode}): {(out + err)[-3000:]}")
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def last_train_step(run: Path) -> int:
    steps = [r["step"] for r in read_metrics(run) if r["kind"] == "train"]
    return max(steps, default=0)


def rank_pid(launcher: subprocess.Popen, rank: int) -> int | None:
    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if " ".join(child.cmdline()).startswith(f"multilane rank {rank}/"):  # engine/start/ranks.py: title
                return child.pid
        except psutil.Error:
            continue
    return None


def long_ddp_run(runs: Path, *settings: str) -> subprocess.Popen:
    args = train_args(runs, "--steps", "100000", task="mlp")
    for s in ("train.log_every=5", "train.eval_every=0", *settings):
        args += ["--set", s]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_a_sigkilled_rank_fails_the_run_within_seconds_and_the_run_resumes(tmp_path):
    runs = tmp_path / "runs"
    p = long_ddp_run(runs, "train.checkpoint_every=10")
    try:
        run = wait_for(lambda: (run_dirs(runs) or [None])[0], 60, "the run folder")
        wait_for(lambda: (run / "checkpoints" / "last.pt").exists(), 120, "a checkpoint")
        pid = wait_for(lambda: rank_pid(p, 1), 30, "rank 1")
        t0 = time.monotonic()
        psutil.Process(pid).kill()
        p.wait(timeout=30)
        elapsed = time.monotonic() - t0
    finally:
        p.kill()
    _, err = p.communicate()
    assert p.returncode == 1
    assert elapsed < 10, f"the run took {elapsed:.1f} s to end"
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "failed"
    assert "rank 1" in status["message"] and "SIGKILL" in status["message"], status
    assert "rank 1" in err and "SIGKILL" in err
    ck = torch.load(run / "checkpoints" / "last.pt", weights_only=True)
    step = int(ck["step"])
    assert step >= 10 and step % 10 == 0
    r = subprocess.run(
        [*CLI, "train", "--resume", str(run), "--steps", str(step + 3)], capture_output=True, text=True, timeout=180
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((run / "status.json").read_text())["state"] == "finished"
    assert last_train_step(run) == step + 3


FAILING_TASK = """
import os
from multilane.engine.tasks.builtin import BUILTIN_TASKS

class Failing(BUILTIN_TASKS["linear"]):
    name = "failing"
    calls = 0

    def loss(self, output, target):
        Failing.calls += 1
        if os.environ.get("RANK") == "1" and Failing.calls > 6:
            raise ValueError("boom on purpose")
        return super().loss(output, target)
"""


@pytest.mark.slow
@pytest.mark.parametrize("when", ["set-up", "train"])
def test_a_rank_killed_with_its_supervisor_is_named_not_the_peer_that_lost_it(tmp_path, when):
    # SIGKILL on the supervisor of a forked rank: the rank dies with it, and nobody is left to write down
    # how. The run must still name rank 1, not rank 0's "Connection reset by peer".
    runs = tmp_path / "runs"
    p = long_ddp_run(runs)
    try:
        run = wait_for(lambda: (run_dirs(runs) or [None])[0], 60, "the run folder")
        wait_for(lambda: rank_pid(p, 1), 30, "rank 1")
        if when == "train":  # else as soon as rank 1 has its title: mostly still in the set-up
            wait_for(lambda: last_train_step(run) >= 5, 120, "training")
        supervisor = None
        for child in psutil.Process(p.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if " ".join(child.cmdline()).startswith("multilane supervisor of rank 1/"):
                    supervisor = child
        if supervisor is None:
            pytest.skip("ranks start as fresh interpreters here (MULTILANE_RANK_START=exec): no supervisor")
        supervisor.kill()
        p.wait(timeout=30)
    finally:
        p.kill()
    _, err = p.communicate()
    assert p.returncode == 1
    status = json.loads((run / "status.json").read_text())
    # "rank 1 (pid N) was killed by SIGKILL" when the agent saw the supervisor die first, else "rank 1
    # ended and left no word of why": either way rank 1, never rank 0's lost peer
    assert status["state"] == "failed" and status["message"].startswith("rank 1 "), status
    assert "failed: rank 1 " in err, err


@pytest.mark.slow
def test_a_rank_that_raises_fails_the_run_naming_the_rank_and_its_error(tmp_path):
    task = tmp_path / "failing.py"
    task.write_text(FAILING_TASK)
    runs = tmp_path / "runs"
    t0 = time.monotonic()
    r = subprocess.run(
        train_args(runs, "--steps", "1000", "--set", "train.log_every=2", task=str(task)),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 1, r.stderr[-3000:]
    assert time.monotonic() - t0 < 120
    (run,) = run_dirs(runs)
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "failed"
    assert "rank 1" in status["message"] and "ValueError: boom on purpose" in status["message"], status
    assert "boom on purpose" in (run / "error.txt").read_text()
    events = [rec for rec in read_metrics(run) if rec.get("event") == "failed"]
    assert events and "rank 1" in events[-1]["message"]
    assert "Traceback" not in r.stderr.split("failed:")[-1]
    assert (r.stdout + r.stderr).count("boom on purpose") == 1, r.stdout + r.stderr  # said once, by the launcher


@pytest.mark.slow
def test_pause_resume_through_the_control_file_then_ctrl_c_stops_every_rank_with_a_checkpoint(tmp_path):
    runs = tmp_path / "runs"
    p = long_ddp_run(runs)
    try:
        run = wait_for(lambda: (run_dirs(runs) or [None])[0], 60, "the run folder")
        wait_for(lambda: last_train_step(run) >= 5, 120, "training")
        subprocess.run([*CLI, "control", str(run), "pause"], check=True, capture_output=True, timeout=60)
        state = lambda: json.loads((run / "status.json").read_text())["state"]  # noqa: E731
        wait_for(lambda: state() == "paused", 30, "the pause")
        paused_at = json.loads((run / "status.json").read_text())["step"]
        time.sleep(1.0)
        assert json.loads((run / "status.json").read_text())["step"] == paused_at
        subprocess.run([*CLI, "control", str(run), "resume"], check=True, capture_output=True, timeout=60)
        wait_for(lambda: state() == "running", 30, "the resume")
        wait_for(lambda: last_train_step(run) > paused_at + 5, 60, "training after the resume")
        p.send_signal(signal.SIGINT)
        p.wait(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 0, p.communicate()[1][-3000:]
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "stopped"
    ck = torch.load(run / "checkpoints" / "last.pt", weights_only=True)
    assert int(ck["step"]) == status["step"] == last_train_step(run)


@pytest.mark.slow
def test_two_nodes_meet_at_a_c10d_rendezvous_one_launched_by_multilane_one_by_torchrun(tmp_path):
    runs = tmp_path / "runs"
    endpoint = f"127.0.0.1:{free_port()}"
    common = ["--steps", "4", "--set", "train.log_every=2", "--set", "telemetry.record_s=0.2"]
    node_a = subprocess.Popen(
        [*train_args(runs, *common, task="mlp", devices="cpu:0"), "--nnodes", "2", "--rdzv-endpoint", endpoint],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    torchrun = [CLI[0], "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
    torchrun += ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "multilane"]
    node_b = subprocess.run(
        [*torchrun, "-m", "multilane.engine.cli", *train_args(runs, *common, task="mlp", devices="cpu:0")[3:]],
        capture_output=True,
        text=True,
        timeout=180,
    )
    _, err_a = node_a.communicate(timeout=180)
    assert node_b.returncode == 0, node_b.stderr[-3000:]
    assert node_a.returncode == 0, err_a[-3000:]
    (run,) = run_dirs(runs)
    records = read_metrics(run)
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [2, 4]
    ranks = sorted(k.split("/")[1] for k in train[-1]["device_loss"])
    assert ranks == ["rank0", "rank1"]
    assert json.loads((run / "status.json").read_text())["state"] == "finished"


def refused_in_one_line(runs: Path, *args: str, task: str = HELPERS) -> str:
    """Run ``multilane train --strategy ddp`` expecting it to refuse (exit 2) within a minute with a
    single line on stderr; that line."""
    t0 = time.monotonic()
    r = subprocess.run(train_args(runs, "--steps", "2", *args, task=task), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert time.monotonic() - t0 < 60
    return lines[0]


@pytest.mark.slow
def test_a_port_in_use_and_a_rendezvous_that_never_completes_are_one_line_each(tmp_path):
    runs = tmp_path / "runs"
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        line = refused_in_one_line(runs, "--rdzv-endpoint", f"127.0.0.1:{port}", task="mlp")
        assert f"127.0.0.1:{port}" in line and "not available" in line, line
        # Several nodes: the port is the rendezvous's, held by something that is no c10d store (torch's
        # client would wait on its handshake forever): one line once --rdzv-timeout has passed.
        line = refused_in_one_line(runs, "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-timeout", "2")
        assert f"rendezvous at 127.0.0.1:{port} did not complete" in line, line
    line = refused_in_one_line(
        runs, "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-timeout", "3"
    )
    assert "rendezvous" in line, line


def test_ranks_whose_launcher_was_sigkilled_stop_with_a_checkpoint(tmp_path):
    runs = tmp_path / "runs"
    p = long_ddp_run(runs)
    try:
        run = wait_for(lambda: (run_dirs(runs) or [None])[0], 60, "the run folder")
        wait_for(lambda: last_train_step(run) >= 5, 120, "training")
        ranks = [wait_for(lambda r=r: rank_pid(p, r), 30, f"rank {r}") for r in (0, 1)]
        p.kill()
        p.wait(timeout=30)
        state = lambda: json.loads((run / "status.json").read_text())["state"]  # noqa: E731
        wait_for(lambda: state() == "stopped", 30, "the ranks to stop")
        wait_for(lambda: not any(psutil.pid_exists(pid) for pid in ranks), 30, "the ranks to exit")
    finally:
        for pid in ranks if "ranks" in locals() else []:
            if psutil.pid_exists(pid):
                psutil.Process(pid).kill()
    ck = torch.load(run / "checkpoints" / "last.pt", weights_only=True)
    assert int(ck["step"]) == json.loads((run / "status.json").read_text())["step"]


@pytest.mark.slow
def test_sigterm_on_the_launcher_stops_every_rank_with_a_checkpoint_and_the_run_resumes_exactly(tmp_path):
    runs = tmp_path / "runs"
    cfg = float64_settings(100000)
    cfg["run"] = {"runs_dir": str(runs), "name": "ddp"}
    cfg["train"]["eval_every"] = 0
    path = tmp_path / "ddp.json"
    path.write_text(json.dumps(cfg))
    p = subprocess.Popen(
        [*CLI, "train", "--strategy", "ddp", "--config", str(path), "--devices", "cpu:0,cpu:1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        run = wait_for(lambda: (run_dirs(runs) or [None])[0], 60, "the run folder")
        wait_for(lambda: last_train_step(run) >= 3, 120, "training")
        ranks = [wait_for(lambda r=r: rank_pid(p, r), 30, f"rank {r}") for r in (0, 1)]
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=60)
    finally:
        p.kill()
    _, err = p.communicate()
    assert p.returncode == 0, err[-3000:]
    assert "stopped" in err
    wait_for(lambda: not any(psutil.pid_exists(pid) for pid in ranks), 30, "the ranks to exit")
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "stopped"
    step = int(torch.load(run / "checkpoints" / "last.pt", weights_only=True)["step"])
    assert step == status["step"] == last_train_step(run)
    # The resumed run continues exactly: the same numbers as a straight run to the same step.
    r = subprocess.run(
        [*CLI, "train", "--resume", str(run), "--steps", str(step + 3)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    ref, ref_records = reference(tmp_path, step + 3)
    assert max_rel_diff(model_from(run), ref.model) <= 1e-10
    train = [x for x in read_metrics(run) if x["kind"] == "train"]
    ref_train = [x for x in ref_records if x["kind"] == "train"]
    assert [x["step"] for x in train] == [x["step"] for x in ref_train]
    for a, b in zip(train, ref_train, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-10 * abs(b["loss"]), (a, b)


def two_nodes(runs: Path, *args: str, task: str = "mlp") -> list[subprocess.Popen]:
    """Two ``multilane train --nnodes 2`` launchers ("nodes") meeting at one c10d rendezvous."""
    endpoint = f"127.0.0.1:{free_port()}"
    node = [*train_args(runs, *args, task=task, devices="cpu:0"), "--nnodes", "2", "--rdzv-endpoint", endpoint]
    return [subprocess.Popen(node, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]


@pytest.mark.slow
def test_a_rank_that_raises_on_the_other_node_fails_the_run_naming_that_rank_and_its_error(tmp_path):
    task = tmp_path / "failing.py"
    task.write_text(FAILING_TASK)
    runs = tmp_path / "runs"
    nodes = two_nodes(runs, "--steps", "1000", "--set", "train.log_every=2", task=str(task))
    try:
        errs = [p.communicate(timeout=180)[1] for p in nodes]
    finally:
        for p in nodes:
            p.kill()
    assert [p.returncode for p in nodes] == [1, 1], errs
    (run,) = run_dirs(runs)
    # Rank 1 is alone on the node without rank 0: rank 0 only lost its peer, and the run says why.
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "failed" and status["rank"] == 1, status
    assert "rank 1" in status["message"] and "ValueError: boom on purpose" in status["message"], status
    assert "boom on purpose" in (run / "error.txt").read_text()
    events = [rec for rec in read_metrics(run) if rec.get("event") == "failed"]
    assert events[-1]["rank"] == 1 and "boom on purpose" in events[-1]["message"]
    assert all("failed: rank 1" in err and "boom on purpose" in err for err in errs), errs


@pytest.mark.slow
@pytest.mark.parametrize("victim", [0, 1])
def test_a_sigkilled_rank_on_either_node_fails_the_run_within_seconds(tmp_path, victim):
    runs = tmp_path / "runs"
    nodes = two_nodes(runs, "--steps", "100000", "--set", "train.log_every=5", "--set", "train.eval_every=0")
    try:
        run = wait_for(lambda: (run_dirs(runs) or [None])[0], 60, "the run folder")
        wait_for(lambda: last_train_step(run) >= 5, 120, "training")
        pid = wait_for(lambda: next(filter(None, (rank_pid(p, victim) for p in nodes)), None), 30, f"rank {victim}")
        t0 = time.monotonic()
        psutil.Process(pid).kill()
        for p in nodes:
            p.wait(timeout=60)
        elapsed = time.monotonic() - t0
        errs = [p.communicate()[1] for p in nodes]
    finally:
        for p in nodes:
            p.kill()
    assert [p.returncode for p in nodes] == [1, 1], errs
    assert elapsed < 15, f"the run took {elapsed:.1f} s to end"
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "failed" and status["rank"] == victim, status
    assert f"rank {victim}" in status["message"] and "SIGKILL" in status["message"], status
    assert all(f"rank {victim}" in err and "SIGKILL" in err for err in errs), errs


@pytest.mark.slow
def test_other_ranks_telemetry_reaches_metrics_within_seconds_even_when_log_windows_are_long(tmp_path):
    runs = tmp_path / "runs"
    p = long_ddp_run(runs, "train.log_every=100000", "telemetry.record_s=0.2")
    try:
        run = wait_for(lambda: (run_dirs(runs) or [None])[0], 60, "the run folder")

        def rank1_telemetry():
            return [r for r in read_metrics(run) if r["kind"] == "telemetry" and r.get("rank") == 1]

        records = wait_for(rank1_telemetry, 60, "rank 1's telemetry")
        assert last_train_step(run) == 0  # no log window has closed: it came on its own
        key = next(iter(records[0]["devices"]))
        assert key.split("/")[1:] == ["rank1", "cpu:1"] and "process" not in records[0]
        p.send_signal(signal.SIGINT)
        p.wait(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 0


@pytest.mark.slow
def test_a_stopped_and_resumed_run_keeps_its_noise_scale_average(tmp_path):
    # The noise scale averages every measured step (noise_scale.py; the record's "steps" counts them):
    # the loop builds health before any strategy restores a checkpoint, so a resumed ddp run goes on
    # from the checkpoint's average, as the lanes do, instead of starting afresh.
    cfg = float64_settings(3)
    cfg["health"] = {"noise_every": 1}
    runs = tmp_path / "runs"
    cfg["run"] = {"runs_dir": str(runs), "name": "ddp"}
    cfg_path = tmp_path / "ddp.json"
    cfg_path.write_text(json.dumps(cfg))
    for extra in (["--config", str(cfg_path)], ["--resume", "RUN", "--steps", "6"]):
        args = [str(run_dirs(runs)[0]) if a == "RUN" else a for a in extra]
        r = subprocess.run(
            [*CLI, "train", "--strategy", "ddp", *args, "--devices", "cpu:0,cpu:1"],
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert r.returncode == 0, r.stderr[-3000:]
    (run,) = run_dirs(runs)
    noise = {r["step"]: r["noise"] for r in read_metrics(run) if r["kind"] == "train" and "noise" in r}
    assert {step: n["steps"] for step, n in noise.items()} == {s: s for s in range(1, 7)}
    saved = torch.load(run / "checkpoints" / "last.pt", weights_only=True)["health"]["noise"]
    assert saved["samples"] == 6 and saved["sums"]["w"] > 0
