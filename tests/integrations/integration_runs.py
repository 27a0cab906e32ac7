"""Shared by the integration tests: run a user's script as a real process and read what it wrote."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from multilane.engine.distributed.launcher import free_port
from multilane.engine.rundir.runlog import load_metrics

HERE = Path(__file__).resolve().parent


def start_script(script: str, tmp_path: Path, *args: str, procs: int = 0) -> subprocess.Popen:
    """``python <script> --runs-dir tmp/runs --out tmp/out ARGS`` (ddp on 127.0.0.1, a free port);
    ``procs``: that many processes under torch's launcher (torchrun), as a Hugging Face user starts ddp."""
    port = str(free_port())
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "PYTHONWARNINGS": "ignore"}
    launch = [sys.executable]
    if procs:
        rdzv = ["--master_addr", "127.0.0.1", "--master_port", port]
        launch += ["-m", "torch.distributed.run", "--nproc_per_node", str(procs), *rdzv]
    cmd = [*launch, str(HERE / script), "--runs-dir", str(tmp_path / "runs"), "--out", str(tmp_path / "out")]
    log = open(tmp_path / "script.log", "wb")  # noqa: SIM115 (the process holds it)
    return subprocess.Popen([*cmd, *args], stdout=log, stderr=subprocess.STDOUT, env=env)


def run_script(script: str, tmp_path: Path, *args: str, timeout: float = 240, rc: int = 0, procs: int = 0) -> Path:
    """Run it to the end (exit status ``rc``); its one run folder."""
    proc = start_script(script, tmp_path, *args, procs=procs)
    code = proc.wait(timeout=timeout)
    assert code == rc, (tmp_path / "script.log").read_text(errors="replace")[-3000:]
    return run_folder(tmp_path)


def run_folder(tmp_path: Path, timeout: float = 180) -> Path:
    """The run folder the script made (waits for it)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        found = sorted((tmp_path / "runs").glob("*/metrics.jsonl"))
        if found:
            return found[0].parent
        time.sleep(0.2)
    raise AssertionError("no run folder: " + (tmp_path / "script.log").read_text(errors="replace")[-3000:])


def records(run_dir: Path, kind: str) -> list[dict]:
    m = load_metrics(run_dir)
    assert m.skipped == 0, "every line must be a record the readers use"
    return [r for r in m.records if r["kind"] == kind]


def status(run_dir: Path) -> dict:
    return json.loads((run_dir / "status.json").read_text())


def logged(tmp_path: Path, rank: int = 0) -> list[dict]:
    """What the user's training_step logged on ``rank``."""
    p = tmp_path / "out" / f"losses-rank{rank}.json"
    return json.loads(p.read_text()) if p.exists() else []


def last_train_step(run_dir: Path) -> int:
    try:
        return max([r["step"] for r in records(run_dir, "train")], default=0)
    except AssertionError:  # a record being written: read again next time
        return 0
