"""MLflow: a run logged live to a real ``mlflow server`` (``tracking.mlflow``) and a run folder sent there later
(``multilane export RUN --mlflow URI``), read back through MLflow's own client."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
from helpers import CLI, run_folders, start_long_cli_run
from mlflow.tracking import MlflowClient
from mlflow_runs import assert_run_equals_its_records, history, records, train
from mlflow_server import free_port
from multilane.integrations import mlflow_records as mr


def test_records_become_mlflow_points_names_and_states():
    maker = mr.PointMaker()
    rec = {"kind": "train", "step": 4, "wall_time": 100.25, "loss": 2.5, "device_loss": {"cuda:1": 2.0}, "lr": 0.1}
    rec["noise"] = {"b_simple": 7.0}
    assert sorted(maker.points(rec)) == [
        ("loss", 2.5, 100250, 4),
        ("loss/cuda_1", 2.0, 100250, 4),
        ("lr", 0.1, 100250, 4),
        ("noise_scale", 7.0, 100250, 4),
    ]
    assert maker.points({**rec, "loss": float("nan"), "device_loss": {}, "lr": None, "noise": None}) == []
    tele = {"kind": "telemetry", "step": 4, "devices": {"cpu:0": {"busy_pct": {"mean": 50.0}}}}
    kept = [t for t in range(20) if maker.points({**tele, "wall_time": 1000.0 + t})]
    assert kept == [0, 5, 10, 15], "telemetry thinned to one record every TELEMETRY_EVERY_S"
    assert mr.end_status("finished") == "FINISHED" and mr.end_status("failed") == "FAILED"
    assert {mr.end_status(s) for s in ("stopped", "aborted", "diverged")} == {"KILLED"}
    assert mr.public_uri("https://ann:s3cret@mlflow.example:5000/x") == "https://mlflow.example:5000/x"
    assert mr.uri_problem("ftp://host/x") and mr.uri_problem("http://host:5000") is None
    refused = (
        "API request to endpoint /api/2.0/mlflow/runs/log-batch failed with error code 401 != 200. Response body: ''"
    )
    assert "MLFLOW_TRACKING_USERNAME" in mr.reason(Exception(refused))
    gone = "Max retries exceeded with url: /api (Caused by ResponseError('too many 503 error responses'))"
    assert mr.reason(Exception(gone)) == "the server answered 503"
    assert len(mr.reason(Exception("x" * 5000 + "\nmore"))) <= 120
    assert len(mr.metric_name("loss", "d" * 400)) == 250
    params = mr.flat_params({"optim": {"lr": 0.5}, "task": {"name": "linear", "params": {}}, "train": {"steps": None}})
    assert params == {"optim.lr": "0.5", "task.name": "linear", "task.params": "{}", "train.steps": "null"}


@pytest.mark.slow
def test_a_live_run_lands_on_the_server_as_its_metrics_jsonl(server, tmp_path):
    # Credentials from MLflow's own variables reach the server (which ignores them), never the run folder.
    env = {**os.environ, "MLFLOW_TRACKING_USERNAME": "ann", "MLFLOW_TRACKING_PASSWORD": "s3cret"}
    r, run = train(tmp_path / "runs", f"tracking.mlflow={server.uri}", "tracking.experiment=live", env=env)
    assert "warning" not in r.stderr, "no warning when the server answers"
    for f in run.rglob("*"):
        assert not f.is_file() or b"s3cret" not in f.read_bytes(), f
    run_id = json.loads((run / "mlflow.json").read_text())["servers"][server.uri]["run_id"]
    client = MlflowClient(server.uri)
    got = client.get_run(run_id)
    assert got.info.status == "FINISHED"
    assert client.get_experiment(got.info.experiment_id).name == "live"
    assert_run_equals_its_records(client, run_id, run)
    config = json.loads((run / "config.json").read_text())
    assert got.data.params == mr.flat_params(config)
    tags = got.data.tags
    assert tags["multilane.strategy"] == config["devices"]["strategy"]
    assert tags["multilane.devices"] == "cpu:0,cpu:1"
    assert tags["multilane.task"] == "linear" and tags["multilane.version"] and tags["multilane.host"]
    assert tags["mlflow.runName"] == run.name
    assert any(k.startswith("telemetry/") for k in got.data.metrics)
    arts = {a.path for a in client.list_artifacts(run_id)} | {a.path for a in client.list_artifacts(run_id, "figures")}
    assert {"config.json", "metrics.jsonl", "figures/loss.png", "figures/loss.pdf"} <= arts
    local = Path(client.download_artifacts(run_id, "metrics.jsonl", str(tmp_path)))
    assert local.read_bytes() == (run / "metrics.jsonl").read_bytes()
    # Resumed: the same MLflow run goes on (running again, then finished), its points extended.
    r = subprocess.run(
        [*CLI, "train", "--resume", str(run), "--steps", "60"], capture_output=True, text=True, timeout=240
    )
    assert r.returncode == 0, r.stderr
    assert json.loads((run / "mlflow.json").read_text())["servers"][server.uri]["run_id"] == run_id
    assert len(client.search_runs([got.info.experiment_id])) == 1
    assert client.get_run(run_id).info.status == "FINISHED"
    assert_run_equals_its_records(client, run_id, run)
    assert history(client, run_id, "loss")[-1][0] == 60


@pytest.mark.slow
def test_a_batch_the_server_refuses_is_dropped_and_the_rest_still_goes(server, tmp_path):
    from multilane.integrations.mlflow import Sender

    problems: list[str] = []
    s = Sender(server.uri, "refused", tmp_path, "refused@1.0", {}, problems.append, live=False)
    s.add([("x" * 300, 1.0, 1000, 0)])  # a name over MLflow's 250 characters: a 400, for good
    s.send_now()
    s.add([("ok", 2.0, 2000, 1)])
    s.send_now()
    assert history(MlflowClient(server.uri), s.run_id, "ok") == [(1, 2.0)]
    assert s.dropped == 1 and len(problems) == 1 and "250" in problems[0]


@pytest.mark.slow
def test_a_past_run_exported_twice_is_one_mlflow_run_without_duplicate_points(server, tmp_path):
    _, run = train(tmp_path / "runs")
    assert not (run / "mlflow.json").exists()
    sends = []
    for _ in range(3):
        r = subprocess.run(
            [*CLI, "export", str(run), "--mlflow", server.uri], capture_output=True, text=True, timeout=120
        )
        assert r.returncode == 0, r.stderr
        sends.append(r.stdout)
        if len(sends) == 2:  # the third send finds the run by its tag, not by the folder's record of it
            (run / "mlflow.json").unlink()
    assert "0 new points" not in sends[0] and all("0 new points" in s for s in sends[1:])
    client = MlflowClient(server.uri)
    exp = client.get_experiment_by_name("multilane")
    found = client.search_runs([exp.experiment_id], filter_string=f"tags.`multilane.run_dir` = '{run.resolve()}'")
    assert len(found) == 1
    assert found[0].info.status == "FINISHED"
    assert_run_equals_its_records(client, found[0].info.run_id, run)


def test_a_batch_refused_for_good_is_told_from_a_refusal_that_may_pass():
    # Unmarked: the fast tier's line of multilane.integrations.mlflow (importing MLflow is ~2.5 s of it).
    from mlflow.exceptions import MlflowException, RestException
    from multilane.integrations.mlflow import _refused_for_good

    assert _refused_for_good(RestException({"error_code": "INVALID_PARAMETER_VALUE", "message": "name too long"}))
    for maybe in ("UNAUTHENTICATED", "PERMISSION_DENIED", "RESOURCE_DOES_NOT_EXIST", "INTERNAL_ERROR"):
        assert not _refused_for_good(RestException({"error_code": maybe, "message": "x"})), maybe
    assert not _refused_for_good(MlflowException("API request failed: Connection refused"))
    assert not _refused_for_good(ConnectionError("refused"))


def test_a_uri_holding_a_password_is_refused_before_anything_is_written(tmp_path):
    args = [*CLI, "train", "--task", "linear", "--steps", "2", "--runs-dir", str(tmp_path / "runs")]
    r = subprocess.run(
        [*args, "--set", "tracking.mlflow=https://ann:s3cret@mlflow.example"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    assert "MLFLOW_TRACKING_USERNAME" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "s3cret" not in r.stderr, "the password is not echoed either"
    assert not run_folders(tmp_path / "runs")


class Refusing(http.server.BaseHTTPRequestHandler):
    """A server that answers every request with ``code`` (a broken proxy, a server refusing credentials)."""

    code = 500

    def _answer(self) -> None:
        self.send_response(self.code)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"no")

    do_GET = do_POST = _answer

    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def refusing_server(code: int):
    handler = type("Handler", (Refusing,), {"code": code})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.mark.slow
def test_an_unreachable_refusing_or_unknown_server_is_one_warning_and_training_finishes(tmp_path):
    closed = f"http://127.0.0.1:{free_port()}"
    with refusing_server(500) as broken, refusing_server(401) as locked:
        cases = {closed: "connection refused", "ftp://mlflow.example/x": "unknown scheme ftp://", broken: "500"}
        cases[locked] = "MLFLOW_TRACKING_USERNAME"
        for i, (uri, words) in enumerate(cases.items()):
            r, run = train(tmp_path / f"runs{i}", f"tracking.mlflow={uri}", steps=200)
            assert r.stderr.count("mlflow:") == 1, r.stderr
            assert words in r.stderr.replace("\n", " "), r.stderr
            assert "Traceback" not in r.stderr
            assert json.loads((run / "status.json").read_text())["state"] == "finished"
            warnings = [x for x in records(run, "event") if x["event"] == "warning"]
            assert len(warnings) == 1 and "mlflow:" in warnings[0]["message"], "the app sees the same one line"


@pytest.mark.slow
def test_a_server_that_never_answers_costs_the_run_one_warning_and_a_bounded_end(tmp_path):
    with socket.socket() as silent:  # accepts connections (the backlog) and never answers a request
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        uri = f"http://127.0.0.1:{silent.getsockname()[1]}"
        env = {**os.environ, "MLFLOW_HTTP_REQUEST_TIMEOUT": "2"}  # the user's own setting is kept
        t0 = time.monotonic()
        r, run = train(tmp_path / "runs", f"tracking.mlflow={uri}", steps=200, env=env)
        took = time.monotonic() - t0
    assert r.stderr.count("mlflow:") == 1 and "no answer in time" in r.stderr.replace("\n", " "), r.stderr
    assert json.loads((run / "status.json").read_text())["state"] == "finished"
    assert took < 30, "the end waits for one more try of the request timeout, not for the server"


@pytest.mark.slow
def test_a_server_killed_mid_run_and_started_again_gets_the_whole_run(server, tmp_path):
    runs = tmp_path / "runs"
    proc = start_long_cli_run(runs, f"tracking.mlflow={server.uri}", "tracking.experiment=restart", "train.log_every=5")
    client = MlflowClient(server.uri)
    try:
        deadline = time.monotonic() + 120

        def wait(what, ok):
            while not ok():
                assert proc.poll() is None, f"the run ended while waiting for {what}"
                assert time.monotonic() < deadline, f"no {what}"
                time.sleep(0.2)

        wait("run folder", lambda: run_folders(runs) and (run_folders(runs)[0] / "mlflow.json").exists())
        (run,) = run_folders(runs)
        run_id = json.loads((run / "mlflow.json").read_text())["servers"][server.uri]["run_id"]
        wait("loss on the server", lambda: client.get_run(run_id).data.metrics.get("loss") is not None)
        server.kill()
        n = len(records(run, "train"))
        wait("train records while the server is down", lambda: len(records(run, "train")) >= n + 20)
        server.start()
        subprocess.run([*CLI, "control", str(run), "stop"], check=True, capture_output=True, timeout=60)
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    got = client.get_run(run_id)
    assert got.info.status == "KILLED", "a stopped run"
    train = records(run, "train")
    assert history(client, run_id, "loss") == sorted((r["step"], r["loss"]) for r in train)


class AnswerDropper:
    """A TCP proxy in front of the server that forwards every request but, for the next ``drops`` log-batch
    requests, takes the server's answer and closes the client's connection instead of relaying it: the
    server stored the batch and the client never hears so (a connection lost at the worst moment)."""

    def __init__(self, port: int, drops: int) -> None:
        self.port, self.drops, self.batches = port, drops, []  # batches: every log-batch request forwarded
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.uri = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = self.listener.accept()
                upstream = socket.create_connection(("127.0.0.1", self.port))
                dropping = threading.Event()
                threading.Thread(target=self._up, args=(client, upstream, dropping), daemon=True).start()
                threading.Thread(target=self._down, args=(upstream, client, dropping), daemon=True).start()

    def _up(self, client: socket.socket, upstream: socket.socket, dropping: threading.Event) -> None:
        batch = None  # the log-batch request being forwarded (its head and body may come apart)
        with contextlib.suppress(OSError):
            while data := client.recv(1 << 20):
                if data.split(b" ", 1)[0] in (b"GET", b"POST", b"PUT", b"PATCH", b"DELETE"):  # a new request
                    batch = None
                    if b"/runs/log-batch" in data.split(b"\r\n", 1)[0]:
                        self.batches.append(batch := bytearray())
                        if self.drops > 0:
                            self.drops -= 1
                            dropping.set()
                if batch is not None:
                    batch += data
                upstream.sendall(data)

    def points(self, k: int) -> list[tuple[str, int]]:
        """The (key, step) of each point the k-th log-batch request carried."""
        body = json.loads(bytes(self.batches[k]).split(b"\r\n\r\n", 1)[1])
        return [(m["key"], int(m["step"])) for m in body.get("metrics", [])]

    def _down(self, upstream: socket.socket, client: socket.socket, dropping: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while data := upstream.recv(1 << 20):
                if dropping.is_set():  # the server answered: it has stored the batch
                    client.shutdown(socket.SHUT_RDWR)
                    client.close()
                    upstream.close()
                    return
                client.sendall(data)

    def close(self) -> None:
        self.listener.close()


@pytest.mark.slow
def test_a_batch_stored_whose_answer_is_lost_is_not_sent_again(server, tmp_path):
    from multilane.integrations.mlflow import Sender

    proxy = AnswerDropper(server.port, drops=0)
    try:
        s = Sender(proxy.uri, "dropped", tmp_path, "dropped@1.0", {}, live=False)
        s.ensure_run()
        proxy.drops = 1
        first = [("loss", 1.5, 1000, 1), ("lr", 0.1, 1000, 1)]
        s.add(first)
        with pytest.raises(Exception, match=r"Connection aborted|Remote end closed"):
            s.send_now()
        assert len(proxy.batches) == 1 and s.pending() == 2, "the batch waits, to be checked"
        s.add([("loss", 1.25, 2000, 2)])
        s.send_now()
        assert s.pending() == 0
    finally:
        proxy.close()
    client = MlflowClient(server.uri)
    assert history(client, s.run_id, "loss") == [(1, 1.5), (2, 1.25)]
    assert history(client, s.run_id, "lr") == [(1, 0.1)]
    # read back, not resent: the second log-batch request holds only the new point
    assert len(proxy.batches) == 2 and proxy.points(0) == [("loss", 1), ("lr", 1)]
    assert proxy.points(1) == [("loss", 2)]
