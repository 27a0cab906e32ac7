"""multilane's own processes forked from a pre-imported server (engine/start/): a forked command ends,
prints and reads its environment as the same command started fresh; it is a session leader as soon as
the call returns; it gets SIGTERM when the process that asked for it dies, however that one dies; a
script with no ``__main__`` guard does not run again; and a launcher's server forked from the launcher
itself is a real forkserver that ends with it. Real processes throughout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch
from helpers import CLI
from multilane.engine.start.server import start_cli


def forked(argv: list[str], tmp_path: Path, **kw) -> tuple[int, str]:
    """(exit status, stdout + stderr) of ``argv`` forked from the server."""
    out = tmp_path / f"out-{time.monotonic_ns()}.txt"
    with open(out, "wb") as f, open(os.devnull, "rb") as null:
        p = start_cli(argv, stdin=null.fileno(), stdout=f.fileno(), stderr=f.fileno(), **kw)
        code = p.wait(timeout=120)
    return code, out.read_text()


def fresh(argv: list[str], **kw) -> tuple[int, str]:
    """The same command as a fresh interpreter (``exec``, not this suite's warm start)."""
    r = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=120, preexec_fn=os.setpgrp, **kw)  # fmt: skip
    return r.returncode, r.stdout


@pytest.mark.parametrize("args", [["--version"], ["bogus"], ["train", "--steps", "0"]], ids=str)
def test_a_forked_command_ends_and_prints_as_the_same_command_started_fresh(tmp_path, args):
    assert forked([*CLI, *args], tmp_path) == fresh([*CLI, *args])


def test_a_forked_command_has_its_folder_environment_and_torch_threads(tmp_path):
    script = tmp_path / "task.py"  # a task file that reports what the process sees, then fails on purpose
    script.write_text(
        textwrap.dedent("""
        import os, sys, torch
        raise SystemExit(f"cwd={os.getcwd()} omp={os.environ.get('OMP_NUM_THREADS')} threads={torch.get_num_threads()}")
    """)
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    code, text = forked([*CLI, "train", "--task", str(script), "--steps", "1"], tmp_path, env=env, cwd=str(tmp_path))
    assert code != 0
    assert f"cwd={tmp_path} omp=1 threads=1" in text, text
    assert torch.get_num_threads() != 1 or os.cpu_count() == 1  # this process's threads are its own


def test_a_forked_command_in_its_own_session_leads_it_when_the_call_returns(tmp_path):
    with open(os.devnull, "rb") as null, open(tmp_path / "log", "wb") as log:
        p = start_cli([*CLI, "train", "--task", "mlp", "--steps", "100000", "--runs-dir", str(tmp_path / "runs")],
                      stdin=null.fileno(), stdout=log.fileno(), stderr=log.fileno(), new_session=True)  # fmt: skip
        try:
            assert os.getsid(p.pid) == p.pid and os.getpgid(p.pid) == p.pid  # no window before setsid
        finally:
            os.killpg(p.pid, signal.SIGKILL)
        assert p.wait(timeout=30) == -signal.SIGKILL


def alive(pid: int) -> bool:
    """Running (a zombie has ended: whoever adopted it has not reaped it yet)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


ASKER = r"""
import os, signal, sys, time
from multilane.engine.start.server import start_cli
CLI = [sys.executable, "-m", "multilane.engine.cli"]
runs = sys.argv[1]
with open(os.path.join(runs, "ran"), "a") as f:  # no __main__ guard: a child that ran this file again adds a line
    f.write("ran\n")
with open(os.devnull, "rb") as null, open(os.path.join(runs, "log"), "wb") as log:
    p = start_cli([*CLI, "train", "--task", "mlp", "--steps", "100000", "--runs-dir", runs,
                   "--set", "train.log_every=5", "--set", "train.eval_every=0"],
                  stdin=null.fileno(), stdout=log.fileno(), stderr=log.fileno(), new_session=True,
                  signal_when_i_end=signal.SIGTERM)
print(p.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_the_asker_killed_with_sigkill_sends_its_forked_command_sigterm_and_it_stops_with_a_checkpoint(tmp_path):
    from multilane.engine.rundir.runlog import STATUS

    script = tmp_path / "asker.py"
    script.write_text(ASKER)
    runs = tmp_path / "runs"
    runs.mkdir()
    asker = subprocess.Popen([sys.executable, str(script), str(runs)], stdout=subprocess.PIPE, text=True)
    try:
        child = int(asker.stdout.readline())
        deadline = time.monotonic() + 120
        while not list(runs.glob("*/metrics.jsonl")) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert list(runs.glob("*/metrics.jsonl")), (runs / "log").read_text()
        asker.kill()  # no handler, no chance to pass anything on: the child's watch of its pidfd does
        asker.wait(timeout=10)
        deadline = time.monotonic() + 60
        while alive(child):
            assert time.monotonic() < deadline, "the forked command outlived its asker"
            time.sleep(0.1)
    finally:
        asker.kill()
        asker.wait()
    (status,) = runs.glob(f"*/{STATUS}")
    assert '"stopped"' in status.read_text()  # a stop with a checkpoint, as SIGTERM asks
    assert list(runs.glob("*/checkpoints/last.pt"))
    assert (runs / "ran").read_text() == "ran\n"  # the asker's file ran once: not again in the forked child


SERVER = """
import os, sys, atexit, multiprocessing, threading
from multilane.engine.start.server import fork_server_here
from multiprocessing import forkserver
mode = sys.argv[1]
if mode == "thread":
    threading.Thread(target=threading.Event().wait, daemon=True).start()
atexit.register(lambda: print("atexit of the launcher", flush=True))
forked = fork_server_here(["json"], "test rank server")
print("forked", forked, forkserver._forkserver._forkserver_pid, flush=True)
if forked:
    ctx = multiprocessing.get_context("forkserver")
    p = ctx.Process(target=os.getppid)
    p.start(); p.join()
    print("child exit", p.exitcode, flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["quiet", "thread"])
def test_a_launchers_server_is_forked_from_it_only_without_threads_and_ends_with_it(tmp_path, mode):
    script = tmp_path / "launcher.py"
    script.write_text(SERVER)
    r = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    if mode == "thread":  # a second thread: no fork; the forkserver starts as usual on first use
        assert lines == ["forked False None", "atexit of the launcher"]
        return
    _, ok, pid = lines[0].split()
    assert ok == "True"
    assert lines[1:] == ["child exit 0", "atexit of the launcher"]  # the launcher's atexit ran once, here
    deadline = time.monotonic() + 10
    while alive(int(pid)):  # the alive pipe closed with the launcher: the server ends too
        assert time.monotonic() < deadline, "the server outlived its launcher"
        time.sleep(0.05)
