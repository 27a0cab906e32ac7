"""The MLflow tests' shared parts: a real ``mlflow server`` (started once per test process), a short run of
the linear task on two CPU lanes, and the check that an MLflow run holds exactly a run folder's records."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

from helpers import CLI, run_folders
from mlflow.tracking import MlflowClient
from mlflow_server import MlflowServer
from multilane.engine.rundir.runread import iter_metrics
from multilane.integrations.mlflow_records import metric_name

SETS = ("train.log_every=2", "train.eval_every=10", "telemetry.record_s=0.2")


def started_server(tmp_path_factory) -> Iterator[MlflowServer]:
    """For the ``server`` fixture (tests/integrations/conftest.py): one real server, stopped after its tests."""
    s = MlflowServer(tmp_path_factory.mktemp("mlflow-server"))
    s.start()
    yield s
    s.stop()


def train(runs: Path, *sets: str, steps: int = 40, env=None) -> tuple[subprocess.CompletedProcess, Path]:
    args = [*CLI, "train", "--task", "linear", "--steps", str(steps), "--devices", "cpu:0,cpu:1"]
    args += ["--runs-dir", str(runs)]
    for s in (*SETS, *sets):
        args += ["--set", s]
    r = subprocess.run(args, capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stderr
    (run,) = run_folders(runs)
    return r, run


def records(run: Path, kind: str) -> list[dict]:
    return [r for r in iter_metrics(run / "metrics.jsonl") if r["kind"] == kind]


def history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def assert_run_equals_its_records(client: MlflowClient, run_id: str, run: Path) -> None:
    """Every train and eval record's numbers on the server once, at the record's step, exactly."""
    train, evals = records(run, "train"), records(run, "eval")
    assert train and evals
    assert history(client, run_id, "loss") == sorted((r["step"], r["loss"]) for r in train)
    devices = sorted(train[-1]["device_loss"])  # cpu:0, cpu:1; under ddp host/rank0/cpu:0, ...
    assert len(devices) == 2
    for dev in devices:
        want = sorted((r["step"], r["device_loss"][dev]) for r in train)
        assert history(client, run_id, metric_name("loss", dev)) == want
    assert history(client, run_id, "lr") == sorted((r["step"], r["lr"]) for r in train)
    assert history(client, run_id, "val_loss") == sorted((r["step"], r["val_loss"]) for r in evals)
    assert history(client, run_id, "val/r2") == sorted((r["step"], r["metrics"]["r2"]) for r in evals)
