"""MLflow from the app and from sweeps: the form's tracking server, the Runs table's Send to MLflow…, a sweep's
trials nested under its run; and a server backed by PostgreSQL instead of SQLite."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import CLI
from mlflow.tracking import MlflowClient
from mlflow_runs import SETS, assert_run_equals_its_records, history, records, train
from mlflow_server import MlflowServer, free_port


def test_the_apps_form_offers_the_tracking_server_and_refuses_a_password_in_it(qtbot):
    from multilane.gui.window.config_form import ConfigForm

    form = ConfigForm()
    qtbot.addWidget(form)
    ed = form.editors["tracking.mlflow"]
    assert "MLflow" in ed.widget.toolTip() and ed.get() == ""
    ed.set("http://mlflow.example:5000")
    values = form.values()
    assert values["tracking"]["mlflow"] == "http://mlflow.example:5000"
    assert form.errors(values) == []
    ed.set("https://ann:s3cret@mlflow.example")
    (problem,) = form.errors(form.values())
    assert "MLFLOW_TRACKING_USERNAME" in problem and "s3cret" not in problem
    assert "s3cret" not in ed.widget.toolTip()


@pytest.mark.slow
def test_the_runs_table_sends_the_selected_runs_and_says_how_each_went(server, tmp_path, qtbot):
    from multilane.gui.table.runs_table import RunsTable

    runs = tmp_path / "runs"
    _, run = train(runs)
    t = RunsTable()
    qtbot.addWidget(t)
    t.load(str(runs))
    assert not t.mlflow.button.isEnabled(), "nothing selected"
    t.select([str(run)])
    assert t.mlflow.button.isEnabled()
    for uri, words in ((server.uri, "new points sent"), (f"http://127.0.0.1:{free_port()}", "connection refused")):
        with qtbot.waitSignal(t.mlflow.finished, timeout=120_000) as sent:
            t.mlflow.send(t.selected_paths(), uri)
        (line,) = sent.args[0]
        assert line.startswith(run.name) and words in line, line
        assert words in t.message.text()
    client = MlflowClient(server.uri)
    (found,) = client.search_runs(
        [client.get_experiment_by_name("multilane").experiment_id],
        filter_string=f"tags.`multilane.run_dir` = '{run.resolve()}'",
    )
    assert_run_equals_its_records(client, found.info.run_id, run)


@pytest.mark.slow
def test_a_sweeps_trials_are_runs_nested_under_the_sweeps_run(server, tmp_path):
    sweeps = tmp_path / "sweeps"
    args = [*CLI, "sweep", "--task", "linear", "--steps", "20", "--devices", "cpu:0,cpu:1", "--trials", "3"]
    args += ["--param", "optim.lr=log:1e-3:1e-2", "--pruner", "none", "--sweeps-dir", str(sweeps), "--no-table"]
    for s in (*SETS, f"tracking.mlflow={server.uri}", "tracking.experiment=sweep"):
        args += ["--set", s]
    r = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    (folder,) = sweeps.iterdir()
    trials = sorted(p for p in folder.iterdir() if p.is_dir() and (p / "metrics.jsonl").exists())
    assert len(trials) == 3
    client = MlflowClient(server.uri)
    runs = client.search_runs([client.get_experiment_by_name("sweep").experiment_id])
    (parent,) = [x for x in runs if "multilane.sweep" in x.data.tags]
    assert parent.info.status == "FINISHED", "the sweep's run ends with its last trial"
    children = [x for x in runs if x.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == len(runs) - 1 == 3
    for trial in trials:
        (child,) = [x for x in children if x.data.tags["multilane.run_dir"] == str(trial.resolve())]
        assert child.info.status == "FINISHED"
        assert history(client, child.info.run_id, "loss") == sorted(
            (x["step"], x["loss"]) for x in records(trial, "train")
        )


@pytest.mark.slow
def test_a_live_run_on_a_server_backed_by_postgresql(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine" / "sweep"))
    from postgres import pg_bin, postgres_server

    if pg_bin("initdb") is None:
        pytest.skip("PostgreSQL is not installed (apt-get install postgresql)")
    with postgres_server() as url:
        pg = MlflowServer(tmp_path / "server", backend=url)
        pg.folder.mkdir()
        pg.start()
        try:
            _, run = train(tmp_path / "runs", f"tracking.mlflow={pg.uri}")
            client = MlflowClient(pg.uri)
            run_id = json.loads((run / "mlflow.json").read_text())["servers"][pg.uri]["run_id"]
            assert client.get_run(run_id).info.status == "FINISHED"
            assert_run_equals_its_records(client, run_id, run)
        finally:
            pg.stop()
