"""A real PostgreSQL server for the sweep tests: initdb in a temporary folder, a server on 127.0.0.1 on a
free port, stopped and removed afterwards. As root (a CI container) it runs as the `postgres` user, since
PostgreSQL refuses to run as root. `.ci/run` installs Debian's `postgresql` package when it is missing."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def pg_bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return candidates[-1] if candidates else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def postgres_server() -> Iterator[str]:
    """Yields a SQLAlchemy URL (postgresql+psycopg://postgres@127.0.0.1:PORT/postgres)."""
    initdb, postgres = pg_bin("initdb"), pg_bin("postgres")
    assert initdb and postgres, "PostgreSQL is not installed (apt-get install postgresql)"
    folder = Path(tempfile.mkdtemp(prefix="multilane-pg-"))  # not under pytest's 0700 root: postgres must reach it
    as_user: list[str] = []
    if os.geteuid() == 0:
        shutil.chown(folder, "postgres", "postgres")
        as_user = ["runuser", "-u", "postgres", "--"]
    data = folder / "data"
    port = _free_port()
    subprocess.run(
        [*as_user, initdb, "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync"],
        check=True,
        capture_output=True,
        timeout=120,
    )
    server = subprocess.Popen(
        [*as_user, postgres, "-D", str(data), "-p", str(port), "-k", str(folder), "-c", "listen_addresses=127.0.0.1",
         "-c", "fsync=off"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"
    try:
        import psycopg

        end = time.monotonic() + 60
        while True:
            try:
                psycopg.connect(f"host=127.0.0.1 port={port} user=postgres dbname=postgres", connect_timeout=2).close()
                break
            except psycopg.OperationalError:
                if time.monotonic() > end or server.poll() is not None:
                    raise
                time.sleep(0.3)
        yield url
    finally:
        server.terminate()  # runuser passes SIGTERM on to postgres: a "smart" shutdown
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)
        shutil.rmtree(folder, ignore_errors=True)
