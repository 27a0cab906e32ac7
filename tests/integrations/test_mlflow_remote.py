"""MLflow from a run on an SSH host: the host logs when it reaches the server; a host that cannot (a network
namespace whose 127.0.0.1 has no server: tests/netns_hosts.py) hands the sending to the mirror on the
launching machine, which sends every record once. A real sshd, a real ``mlflow server``, no mock network."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from helpers import CLI
from mlflow.tracking import MlflowClient
from mlflow_runs import SETS, assert_run_equals_its_records, records, started_server
from multilane.integrations import mlflow_records as mr
from netns_hosts import netns_hosts  # noqa: F401 (the fixture)
from sshd_server import MULTILANE

pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from started_server(tmp_path_factory)


def train_on(host: str, command: str, remote_runs: Path, local: Path, uri: str, env: dict) -> tuple[str, Path, Path]:
    """``train --host`` followed to its end: (its output, the host's run folder, the mirror)."""
    args = [*CLI, "train", "--host", host, "--remote-command", command, "--remote-runs-dir", str(remote_runs)]
    args += ["--runs-dir", str(local), "--task", "linear", "--steps", "20", "--devices", "cpu:0,cpu:1"]
    for s in (*SETS, f"tracking.mlflow={uri}", f"tracking.experiment=remote-{host}"):
        args += ["--set", s]
    p = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, (p.stdout, p.stderr)
    (mirror,) = [f for f in local.iterdir() if f.is_dir()]
    there = Path(json.loads((mirror / "remote.json").read_text())["path"])
    assert (mirror / "metrics.jsonl").read_bytes() == (there / "metrics.jsonl").read_bytes()
    return p.stdout + p.stderr, there, mirror


def the_mlflow_run(client: MlflowClient, host: str, there: Path):
    """The run's one MLflow run (the host's or the mirror's, never both), once ended: the host's process
    sends the end after its final status, which ends the follow."""
    exp = client.get_experiment_by_name(f"remote-{host}")
    deadline = time.monotonic() + 60
    while True:
        (run,) = client.search_runs([exp.experiment_id])
        if run.info.status != "RUNNING" or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert run.data.tags["mlflow.runName"] == there.name and run.data.tags["multilane.run_dir"] == str(there)
    assert run.info.status == "FINISHED"
    return run


def hand_overs(run: Path) -> list[dict]:
    return [r for r in records(run, "event") if r["event"] == "warning" and r.get(mr.HAND_OVER_FIELD)]


@pytest.mark.slow
def test_a_host_that_reaches_the_server_logs_its_run_itself(sshd, server, tmp_path):
    out, there, mirror = train_on("testhost", MULTILANE, sshd.runs, tmp_path / "local", server.uri, sshd.env())
    assert "mlflow" not in out, out
    client = MlflowClient(server.uri)
    run = the_mlflow_run(client, "testhost", there)
    assert not hand_overs(there)
    assert json.loads((there / "mlflow.json").read_text())["servers"][server.uri]["run_id"] == run.info.run_id
    assert not (mirror / "mlflow.json").exists(), "the mirror sent nothing"
    assert_run_equals_its_records(client, run.info.run_id, there)


@pytest.mark.slow
def test_a_host_that_cannot_reach_the_server_hands_its_run_to_the_mirror(sshd, netns_hosts, server, tmp_path):  # noqa: F811
    h = netns_hosts
    probe = f"import socket; socket.create_connection(('127.0.0.1', {server.port}), 2)"
    assert h.ns(0, "python3", "-c", probe, check=False).returncode != 0, "the host must not reach the server"
    out, there, mirror = train_on(h.aliases[0], h.commands[0], h.runs[0], tmp_path / "local", server.uri, sshd.env())
    (handed,) = hand_overs(there)
    assert "connection refused" in handed["message"] and handed[mr.HAND_OVER_FIELD] == server.uri
    assert out.count("the mirror on the launching machine sends the run") == 1, out
    assert not (there / "mlflow.json").exists(), "the host never reached the server"
    client = MlflowClient(server.uri)
    run = the_mlflow_run(client, h.aliases[0], there)
    assert json.loads((mirror / "mlflow.json").read_text())["servers"][server.uri]["run_id"] == run.info.run_id
    assert_run_equals_its_records(client, run.info.run_id, mirror)
    arts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.json", "metrics.jsonl"} <= arts
    # An export of the mirror afterwards finds the same MLflow run and has nothing left to send.
    p = subprocess.run([*CLI, "export", str(mirror), "--mlflow", server.uri], capture_output=True, text=True)
    assert p.returncode == 0 and f"0 new points sent to run {run.info.run_id}" in p.stdout, (p.stdout, p.stderr)
