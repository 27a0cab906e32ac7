"""The MLflow tests' one real ``mlflow server`` per test process (``mlflow_server.py``), shared by the MLflow
test modules: each test uses an experiment of its own, and the test that kills the server starts it again on
the same port and database."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    from mlflow_runs import started_server

    yield from started_server(tmp_path_factory)
