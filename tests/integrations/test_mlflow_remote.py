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
from mlflow_runs import SETS, assert_run_equals_its_records, history, records
from multilane.integrations import mlflow_records as mr
from netns_hosts import netns_hosts  # noqa: F401 (the fixture)
from sshd_server import MULTILANE

pytestmark = pytest.mark.timeout(400)


def train_on(
    host: str, command: str, remote_runs: Path, local: Path, uri: str, env: dict, *more: str, during=None
) -> tuple[str, Path, Path]:
    """``train --host`` followed to its end (``during(proc)`` meanwhile): (its output, the host's run
    folder, the mirror)."""
    args = [*CLI, "train", "--host", host, "--remote-command", command, "--remote-runs-dir", str(remote_runs)]
    args += ["--runs-dir", str(local), "--task", "linear", "--devices", "cpu:0,cpu:1"]
    for s in (*SETS, f"tracking.mlflow={uri}", f"tracking.experiment=remote-{host}"):
        args += ["--set", s]
    args += more
    proc = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, stdin=subprocess.DEVNULL
    )
    try:
        if during is not None:
            during(proc)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, (out, err)
    (mirror,) = [f for f in local.iterdir() if f.is_dir()]
    there = Path(json.loads((mirror / "remote.json").read_text())["path"])
    assert (mirror / "metrics.jsonl").read_bytes() == (there / "metrics.jsonl").read_bytes()
    return out + err, there, mirror


def wait(what: str, ok, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while not ok():
        assert proc.poll() is None, f"the run ended while waiting for {what}: {proc.communicate()}"
        assert time.monotonic() < deadline, f"no {what}"
        time.sleep(0.2)


def the_mlflow_run(client: MlflowClient, host: str, there: Path, status: str = "FINISHED"):
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
    assert run.info.status == status
    return run


def hand_overs(run: Path) -> list[dict]:
    return [r for r in records(run, "event") if r["event"] == "warning" and r.get(mr.HAND_OVER_FIELD)]


@pytest.mark.slow
def test_a_host_that_reaches_the_server_logs_its_run_itself_from_one_rank(sshd, server, tmp_path):
    local, env = tmp_path / "local", sshd.env()
    more = ("--strategy", "ddp", "--steps", "20")
    out, there, mirror = train_on("testhost", MULTILANE, sshd.runs, local, server.uri, env, *more)
    assert "mlflow" not in out, out
    ranks = sorted(k.split("/", 1)[1] for k in records(there, "train")[-1]["device_loss"])
    assert ranks == ["rank0/cpu:0", "rank1/cpu:1"], "a ddp run: each rank's loss, logged by rank 0"
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
    client = MlflowClient(server.uri)

    def live(proc: subprocess.Popen) -> None:
        """The hand-over comes mid-run; the mirror then sends each new record as it comes; stopped then."""
        runs = h.runs[0]
        wait("the run folder", lambda: any((r / "metrics.jsonl").exists() for r in runs.iterdir()), proc)
        (run,) = list(runs.iterdir())
        wait("the hand-over", lambda: hand_overs(run), proc)
        after = hand_overs(run)[0]["step"]

        def sent_after() -> bool:
            exp = client.get_experiment_by_name(f"remote-{h.aliases[0]}")
            found = client.search_runs([exp.experiment_id]) if exp else []
            return (
                bool(found)
                and max((s for s, _ in history(client, found[0].info.run_id, "loss")), default=-1) > after + 100
            )

        wait("points the mirror sent after the hand-over", sent_after, proc)
        subprocess.run([*CLI, "control", str(run), "stop"], check=True, capture_output=True, timeout=60)

    more = ("--steps", "1000000", "--set", "train.log_every=50", "--set", "train.eval_every=500")
    out, there, mirror = train_on(
        h.aliases[0], h.commands[0], h.runs[0], tmp_path / "local", server.uri, sshd.env(), *more, during=live
    )
    (handed,) = hand_overs(there)
    assert "connection refused" in handed["message"] and handed[mr.HAND_OVER_FIELD] == server.uri
    assert out.count("the mirror on the launching machine sends the run") == 1, out
    assert not (there / "mlflow.json").exists(), "the host never reached the server"
    run = the_mlflow_run(client, h.aliases[0], there, "KILLED")  # a stopped run
    assert json.loads((mirror / "mlflow.json").read_text())["servers"][server.uri]["run_id"] == run.info.run_id
    assert_run_equals_its_records(client, run.info.run_id, mirror)
    arts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.json", "metrics.jsonl"} <= arts
    # An export of the mirror afterwards finds the same MLflow run and has nothing left to send.
    p = subprocess.run([*CLI, "export", str(mirror), "--mlflow", server.uri], capture_output=True, text=True)
    assert p.returncode == 0 and f"0 new points sent to run {run.info.run_id}" in p.stdout, (p.stdout, p.stderr)


def test_the_mirror_sends_from_a_hand_over_to_the_next_start_of_the_host(tmp_path):
    # Unmarked: the mirror's reading of the hand-over (no server needed: a closed port, nothing reaches it).
    from mlflow_server import free_port
    from multilane.integrations.mlflow_logger import MirrorLogger

    uri = f"http://127.0.0.1:{free_port()}"
    (tmp_path / "config.json").write_text(json.dumps({"tracking": {"mlflow": uri}, "task": {"name": "linear"}}))

    def rec(kind: str, step: int, **kw) -> dict:
        return {"kind": kind, "step": step, "wall_time": 1000.0 + step, **kw}

    handed = rec("event", 2, event="warning", message="handed", **{mr.HAND_OVER_FIELD: uri})
    lines = [rec("event", 0, event="started"), rec("train", 1, loss=1.0), rec("train", 2, loss=0.5)]
    lines += [handed, rec("train", 3, loss=0.25), rec("event", 3, event="started"), rec("train", 4, loss=0.125)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines[:2]))
    m = MirrorLogger(tmp_path)
    m.poll(force=True)
    assert m.sender is None, "no hand-over: the host sends, the mirror nothing"
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    m.poll(force=True)
    try:
        s = m.sender
        assert s is not None and not m.owner, "the host's new process (a resume) sends again"
        with s._cv:
            queued = sorted(p[3] for p in [*s._check, *s._points])
        assert queued == [1, 2, 3], "every point up to the host's next start, none after it"
        assert [p[3] for p in s._check] == [1, 2], "those before the hand-over are read back first"
    finally:
        assert m.close(0.5) is False, "the server is not there: nothing was sent"
