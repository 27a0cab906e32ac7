"""A real ``mlflow server`` on 127.0.0.1 for the MLflow tests: a SQLite (or PostgreSQL) backend and an artifact folder in a
temporary folder, one worker, on a free port; it can be killed (SIGKILL, its whole process group) and
started again on the same port and database, as a team's server restarts."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    def __init__(self, folder: Path, backend: str | None = None) -> None:
        self.folder = folder
        self.backend = backend or f"sqlite:///{folder / 'mlflow.db'}"  # or a PostgreSQL URL
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.log = folder / "server.log"

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 180) -> None:
        mlflow = Path(sys.executable).with_name("mlflow")
        cmd = [str(mlflow), "server", "--backend-store-uri", self.backend]
        cmd += ["--artifacts-destination", str(self.folder / "artifacts"), "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port), "--workers", "1"]
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no job runner: a faster start
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=env, start_new_session=True)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        raise RuntimeError(f"mlflow server did not answer in {timeout} s: {self.log.read_text()[-2000:]}")

    def _signal(self, sig: int, wait: float) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(wait)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def kill(self) -> None:
        """Gone at once (SIGKILL to the server and its workers), as a crashed or unplugged server."""
        self._signal(signal.SIGKILL, 10)

    def stop(self) -> None:
        self._signal(signal.SIGTERM, 20)
