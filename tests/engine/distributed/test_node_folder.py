"""A launcher's node folder (its ranks' notes to it) lives while the launcher or its ranks do, and is
removed by the next launch once they are all gone, even when the launcher was killed with SIGKILL and
could not remove it itself. Real processes (forked), real locks, a temp folder of the test's own."""

from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path

import pytest
from multilane.engine.start.ranks import NODE_PREFIX, node_folder


@pytest.fixture
def own_tmp(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def _launcher_holding_a_folder() -> tuple[int, Path]:
    """A forked "launcher" that made its node folder and lives on (as a SIGKILLed one's ranks would)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: make the folder, say where, wait to be killed
        try:
            os.close(r)
            os.write(w, str(node_folder()).encode())
            os.close(w)
            time.sleep(120)
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        return pid, Path(f.read())


def _age(folder: Path, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(folder, (t, t))


def test_a_killed_launchers_folder_goes_at_the_next_launch_and_a_live_ones_stays(own_tmp):
    live_pid, live = _launcher_holding_a_folder()
    dead_pid, dead = _launcher_holding_a_folder()
    try:
        os.kill(dead_pid, signal.SIGKILL)
        os.waitpid(dead_pid, 0)
        for f in (live, dead):
            _age(f, 120)
        young = Path(tempfile.mkdtemp(prefix=NODE_PREFIX))  # being made this minute: no lock yet
        unlocked_old = Path(tempfile.mkdtemp(prefix=NODE_PREFIX))  # a launcher's from before the lock
        _age(unlocked_old, 2 * 86400)
        other = own_tmp / "someone-elses"
        other.mkdir()

        mine = node_folder()  # the next launch

        assert mine.is_dir() and mine.name.startswith(NODE_PREFIX) and (mine / ".held").is_file()
        assert live.is_dir() and young.is_dir() and other.is_dir()
        assert not dead.exists() and not unlocked_old.exists()
    finally:
        os.kill(live_pid, signal.SIGKILL)
        os.waitpid(live_pid, 0)
    _age(live, 120)
    node_folder()
    assert not live.exists()  # its launcher gone too: the launch after removes it
