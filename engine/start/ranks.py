"""Starting a node's ranks from a process that has already imported torch.

Each rank is ``multilane train`` again (``worker.py``). Started as a fresh interpreter, every rank pays
for importing torch, its compiler front end (``torch.optim`` loads ``torch._dynamo`` with the first
optimizer) and the engine before its first step: about 4 s of CPU per rank on a quiet 2-core machine,
more than a short run's training. torch's elastic agent can start its workers as a function in a
``forkserver`` instead: one server process imports these modules once, and each rank is forked from it.
Nothing a rank computes changes: the server has imported modules and run nothing, touched no device
(no CUDA context to inherit) and started no thread.

What the agent starts is a small supervisor: it forks the rank itself and waits for it. torch's agent
reports one failure of a function worker (the first it sees), so a rank killed by a signal (the OOM
killer's SIGKILL) could be hidden behind its peers' "connection closed"; the supervisor sees how its
rank ended and leaves that in the node's folder (``DEATHS``), where the launcher reads it as it read the
exit status of a rank it had started itself. It passes the agent's SIGTERM and SIGINT on to the rank,
which dies with it if the agent has to kill it (``PR_SET_PDEATHSIG``); the supervisor ends with the rank's
own status. ``MULTILANE_RANK_START=exec`` starts each rank as a fresh interpreter instead, as torchrun
does by default. Measured in bench/rank_start.py; docs/design.md, "Ranks start from a pre-imported server".
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import multiprocessing
import os
import select
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import setproctitle
from multilane.engine.start import NODE_FILE_ENV
from multilane.engine.start.parent_death import die_with_parent
from multilane.engine.start.server import end_server as server_end
from multilane.engine.start.server import fork_server_here, start_way

ENV = "MULTILANE_RANK_START"
DEATHS = "deaths"  # in the node's folder (beside NODE_FILE_ENV's file): rank<N>.json, a rank killed by a signal

PRELOAD = [
    "torch",
    "torch._dynamo",
    "torch.distributed",
    "numpy",
    "pydantic",
    "psutil",
    "rich.console",
    "setproctitle",
    "multilane.engine.cli.main",
    "multilane.engine.display.progress",
    "multilane.engine.distributed.ddp",
    "multilane.engine.distributed.worker",
    "multilane.engine.distributed.fsdp_rank",
    "multilane.engine.tasks",
]
"""What the server imports before it forks a rank. No module of the engine reads a setting when it
loads (each reads the environment when it runs), so a rank's own environment still decides."""


def way() -> str:
    """How this launcher starts its ranks: ``$MULTILANE_RANK_START``, forkserver unless it says exec."""
    return start_way(ENV)


def start_method(chosen: str) -> str:
    """The agent's start method for function workers (binaries ignore it), the server told what to import."""
    if chosen == "forkserver":
        # The server starts with the first rank, after the rendezvous: it copies this launcher's
        # environment then, which holds everything the launcher sets for its ranks.
        multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    return "forkserver" if chosen == "forkserver" else "spawn"


def fork_server(chosen: str) -> None:
    """With the forkserver way, start the server now as a fork of this launcher, which has imported what
    it would import (``server.fork_server_here``): call it once the ranks' environment is set and before
    any thread starts (the rendezvous)."""
    if chosen == "forkserver":
        fork_server_here(PRELOAD, f"multilane rank server (launcher {os.getpid()})")


def end_server(chosen: str) -> None:
    """After the ranks: the ranks' server ends before this launcher does (``server.end_server``)."""
    if chosen == "forkserver":
        server_end()


def worker(chosen: str, argv: list[str]) -> tuple[Callable[..., Any] | str, tuple[Any, ...]]:
    """What the agent runs as each rank, and its arguments."""
    if chosen == "exec":
        return sys.executable, ("-m", "multilane.engine.cli", "train", *argv)
    return supervise_rank, (list(argv), os.getpid())


def title(env: Any) -> str:
    """``multilane rank 1/2``: the start of a forked rank's process title (its global rank of all)."""
    return f"multilane rank {env.get('RANK', '?')}/{env.get('WORLD_SIZE', '?')}"


def supervise_rank(argv: list[str], launcher: int) -> None:
    """The agent's worker: fork the rank, pass signals on, end as it ended (see the module's text).
    ``launcher``: the launcher's pid; when it is gone the rank is asked to stop (SIGTERM), with a
    checkpoint, as a rank started by the launcher itself stops when its parent goes."""
    try:
        gone: int | None = os.pidfd_open(launcher)  # readable once the launcher has ended
    except OSError:  # already gone (or a kernel without pidfds: the agent's signals still reach the rank)
        gone = None
    pid = os.fork()
    if pid == 0:
        _run_rank(argv)
    asked: list[int] = []  # the agent's signals: it is stopping the ranks, and takes no result

    def on_signal(signum: int, frame: Any) -> None:
        asked.append(signum)
        _pass_on(pid, signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    # Not "multilane rank 1/2 ...": that names the rank itself, what ps, pkill -f and a user look for.
    setproctitle.setproctitle(f"multilane supervisor of {title(os.environ)[len('multilane ') :]} (pid {pid})")
    try:  # readable once the rank has ended: its end is written down at once, before its peers' reports
        ended: int | None = os.pidfd_open(pid)
    except OSError:
        ended = None
    orphan = False
    while True:
        watched = [fd for fd in (gone, ended) if fd is not None]
        ready, _, _ = select.select(watched, [], [], 0.5)
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if gone is not None and gone in ready:
            _pass_on(pid, signal.SIGTERM)
            os.close(gone)
            gone, orphan = None, True
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        _record_death(int(os.environ.get("RANK", "-1")), pid, -code)
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    if orphan or asked:  # no agent to take a result: torch's wrapper would wait for it to (30 s, or forever)
        os._exit(code)
    if code:
        raise SystemExit(code)


def _pass_on(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


def _run_rank(argv: list[str]) -> None:
    """The rank itself, in the supervisor's child: ``multilane train ARGV`` as a fresh interpreter runs it
    (``worker.run_rank`` ends the process with its exit status)."""
    code = 1
    try:
        parent = os.getppid()
        die_with_parent(signal.SIGKILL)
        if os.getppid() != parent:
            os._exit(1)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL if sig == signal.SIGTERM else signal.default_int_handler)
        # the platform's start method for the rank's own processes (DataLoader workers), as in a fresh
        # interpreter: a process of the server inherits "forkserver", whose server cannot import a user's task
        multiprocessing.set_start_method(None, force=True)
        from multilane.engine.cli.main import main

        command = [sys.executable, "-m", "multilane.engine.cli", "train", *argv]
        # ps, top and a search by command line see which rank this is and the command it runs, not the
        # server's command line (a forked process's environment as /proc shows it is the server's, too)
        setproctitle.setproctitle(f"{title(os.environ)}: {' '.join(command)}")
        sys.argv = command[2:]
        code = main(["train", *argv])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _record_death(rank: int, pid: int, signum: int) -> None:
    node_file = os.environ.get(NODE_FILE_ENV)
    if not node_file:
        return
    folder = Path(node_file).parent / DEATHS
    try:
        folder.mkdir(exist_ok=True)
        note = {"rank": rank, "pid": pid, "signal": signal.Signals(signum).name, "time": time.time()}
        (folder / f"rank{rank}.json").write_text(json.dumps(note))
    except (OSError, ValueError):
        pass


def deaths(node_dir: Path) -> list[dict[str, Any]]:
    """This node's ranks that a signal killed, as the launcher's notes of them (``failures.py``)."""
    out = []
    for f in sorted((node_dir / DEATHS).glob("rank*.json")):
        try:
            d = json.loads(f.read_text())
            message = f"rank {d['rank']} (pid {d['pid']}) was killed by {d['signal']}"
            out.append({"rank": int(d["rank"]), "message": message, "lost_peers": False, "time": float(d["time"])})
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


NODE_PREFIX = "multilane-node-"
HELD = ".held"


def node_folder() -> Path:
    """A new folder of this launcher's node (the ranks' notes to it: the run folder, their deaths), held
    by an ``flock`` on its ``.held`` for as long as this process (and what it forks: the ranks' server)
    lives. The launcher removes its folder as it ends; a launcher killed with SIGKILL cannot, so folders
    of this user whose lock is free (their launcher and its ranks all gone) are removed here first."""
    tmp = Path(tempfile.gettempdir())
    for stale in tmp.glob(f"{NODE_PREFIX}*"):
        with contextlib.suppress(OSError):
            if stale.is_dir() and not stale.is_symlink() and stale.stat().st_uid == os.getuid():
                _remove_if_unheld(stale)
    folder = Path(tempfile.mkdtemp(prefix=NODE_PREFIX))
    fd = os.open(folder / HELD, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # kept open (not inheritable across exec) until exit
    return folder


def _remove_if_unheld(folder: Path) -> None:
    if time.time() - folder.stat().st_mtime < 60:  # one being made this minute: its lock may come next
        return
    try:
        fd = os.open(folder / HELD, os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:  # a folder of a launcher from before the lock: gone once a day old
        if time.time() - folder.stat().st_mtime > 86400:
            shutil.rmtree(folder, ignore_errors=True)
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return  # held: a live launcher's (or its ranks')
    finally:
        os.close(fd)
    shutil.rmtree(folder, ignore_errors=True)
