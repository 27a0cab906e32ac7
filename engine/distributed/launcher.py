"""Starting a ddp run through torch.distributed's own elastic launcher, and reporting how it ended.

``multilane train --strategy ddp`` calls ``launch``: torch's ``elastic_launch`` (torchrun's machinery:
a c10d rendezvous, the local elastic agent, one worker process per device) runs ``multilane train``
again in each worker, where it becomes one rank (``worker.py``). The agent watches its workers: when
one raises or is killed it stops the others at once (SIGTERM, SIGKILL after a grace period), and a
signal to the launcher (Ctrl+C, SIGTERM) is passed on to every rank, which stop together at the same
step with a checkpoint. The launcher then writes the outcome into the run folder (``failures.py``):
which rank failed and with what error, also when that rank ran on another node. A rendezvous that
never completes ends the launcher with one line (``RendezvousWatchdog``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from multilane.engine.config import RunConfig
from multilane.engine.distributed import NODE_FILE_ENV, RUN_DIR_ENV
from multilane.engine.distributed.failures import (
    LOST_PEER_ERROR,
    LOST_PEERS,
    FolderAsFound,
    consolidate,
    note_silent_ranks,
    notes_from_child_failure,
    primary,
    refusal,
    write_note,
)
from multilane.engine.errors import EXIT_DIVERGED, UserError
from multilane.engine.rundir.follow import DIVERGED
from multilane.engine.rundir.run_lock import lock_run_folder
from multilane.engine.rundir.runlog import STATUS, RunDir
from multilane.engine.start import ranks as rank_start
from multilane.engine.telemetry.devices import cuda_count, default_devices, parse_devices

FOREIGN_CAUSE_WAIT_S = 5.0
"""With several nodes: how long a launcher whose ranks only lost their peers waits for the note of
the failure on another node that caused it."""

LOCK_WAIT_S = 10.0
"""How long a launcher whose ranks failed waits for the run folder's lock before it records the
failure: a rank's lock goes with its process, a moment after the agent sees it exit."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def parse_endpoint(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"--rdzv-endpoint {text!r}: expected HOST:PORT, e.g. 127.0.0.1:29500")
    return host, int(port)


def check_port_free(host: str, port: int) -> None:
    """The single-node launcher hosts the rendezvous: refuse a port something else holds."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError as e:
            raise UserError(
                f"rendezvous port {host}:{port} is not available ({e.strerror or e}); "
                "choose another with --rdzv-endpoint or leave it out to pick a free one"
            ) from None


def processes_per_node(config: RunConfig) -> int:
    """One process per device of this node's list; the list and the backend checked against this
    machine first (``UserError``, one line: the CLI exits 2 before any process starts): GPUs that are
    not there, more CPU lanes than the limit (``parse_devices``), NCCL without GPUs or with one GPU
    listed twice (NCCL refuses both; each rank would print its own traceback)."""
    spec = config.devices.use
    devices = default_devices() if spec.strip().lower() == "auto" else parse_devices(spec)
    if config.devices.ddp_backend == "nccl":
        names = [d.name for d in devices]
        if not all(d.is_cuda for d in devices):
            why = "torch sees no CUDA GPU here" if not cuda_count() else "it lists CPU lanes"
            raise UserError(
                f"devices.ddp_backend = nccl needs a GPU per process; devices.use = {spec} is "
                f"{','.join(names)} on this machine ({why}); use ddp_backend gloo or auto"
            )
        twice = next((n for n in names if names.count(n) > 1), None)
        if twice:
            raise UserError(
                f"devices.ddp_backend = nccl: {twice} is listed twice, and NCCL refuses two processes on one "
                "GPU; use ddp_backend gloo or auto"
            )
    return len(devices)


def launch(
    argv: list[str],
    config: RunConfig,
    resume_from: str | None = None,
    nnodes: int = 1,
    rdzv_endpoint: str | None = None,
    rdzv_timeout_s: float = 60.0,
    rdzv_id: str | None = None,
    node_rank: int | None = None,
) -> int:
    """Run ``multilane train ARGV`` as ``nproc`` ranks on this node (of ``nnodes``); the exit status.

    ``node_rank``: this node's place, fixed (torch's static rendezvous: node 0 holds the store at the
    endpoint, and global rank 0, the run folder's writer, is its first rank). Without it the c10d
    rendezvous orders the nodes by host name, so rank 0 may land on any of them."""
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    nproc = processes_per_node(config)  # the machine can run it: checked before a folder or a process
    start = rank_start.way()
    if node_rank is not None and not 0 <= node_rank < nnodes:
        raise UserError(f"--node-rank {node_rank}: expected 0 to {nnodes - 1} (--nnodes {nnodes})")
    run_dir: Path | None = Path(resume_from) if resume_from else None
    made_here = False
    if nnodes == 1:
        host, port = parse_endpoint(rdzv_endpoint) if rdzv_endpoint else ("127.0.0.1", free_port())
        check_port_free(host, port)
        endpoint = f"{host}:{port}"
        if run_dir is None and os.environ.get(RUN_DIR_ENV):  # made by the app that started us
            run_dir = Path(os.environ[RUN_DIR_ENV])
        elif run_dir is None:  # the launcher makes the folder, so that it can report any rank's failure
            made = RunDir.create(config.run.runs_dir, config.run.name)
            made.set_status("starting", "starting the ranks", phase="starting the ranks", step=0)  # seen at once
            made.close()  # rank 0 takes the folder's lock: it is the run's writer
            run_dir, made_here = made.path, True
            os.environ[RUN_DIR_ENV] = str(run_dir)
    else:
        if not rdzv_endpoint:
            raise UserError(f"--nnodes {nnodes}: give --rdzv-endpoint HOST:PORT, the same on every node")
        endpoint = "{}:{}".format(*parse_endpoint(rdzv_endpoint))
        if run_dir is None and node_rank == 0 and os.environ.get(RUN_DIR_ENV):  # made by multi_host.py
            run_dir = Path(os.environ[RUN_DIR_ENV])
    if not config.devices.use.startswith("cuda"):
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    quiet_torch_loggers()  # the launcher reports outcomes itself
    lc = LaunchConfig(
        min_nodes=nnodes,
        max_nodes=nnodes,
        nproc_per_node=nproc,
        run_id=rdzv_id or (f"multilane-{uuid.uuid4().hex[:8]}" if nnodes == 1 else "multilane"),
        rdzv_backend="c10d" if node_rank is None else "static",
        rdzv_endpoint=endpoint,
        rdzv_configs=(
            {"join_timeout": int(rdzv_timeout_s), "read_timeout": int(rdzv_timeout_s)}
            if node_rank is None
            else {"rank": node_rank, "timeout": int(rdzv_timeout_s)}
        ),
        max_restarts=0,
        monitor_interval=0.1,
        start_method=rank_start.start_method(start),  # forked from a process that has imported torch
    )
    # The ranks tell this launcher the run folder (several nodes: rank 0 makes it) through this file.
    node_file = rank_start.node_folder() / "run_dir"
    os.environ[NODE_FILE_ENV] = str(node_file)
    what = f"{nnodes} node(s)" if nnodes > 1 else "the local ranks"
    rank_start.fork_server(start)  # the ranks' server: a fork of this process, before any thread starts
    watchdog = RendezvousWatchdog(endpoint, what, rdzv_timeout_s)
    as_found = FolderAsFound(run_dir, made_here)
    try:
        entrypoint, args = rank_start.worker(start, argv)
        elastic_launch(lc, entrypoint)(*args)
    except ChildFailedError as e:
        _raise_refusal(node_file.parent, as_found)
        return _report_failure(run_dir or _run_dir_of_node(node_file), node_file.parent, nnodes, e, nproc)
    except SignalException:
        state = _state(run_dir)
        print(f"{state or 'stopped'}: by signal; every rank was asked to stop", file=sys.stderr)
        return 0 if state == "stopped" else 1
    except (RendezvousError, DistError) as e:  # DistError: the static rendezvous's store timed out
        if nnodes > 1 and watchdog.ranks_started:
            _raise_refusal(node_file.parent, as_found)
            # The ranks ran: the store went with the node that held it, which ended as the run failed
            # (torch's agent asks the store between its looks at the ranks). The run's failure is the news.
            return _report_failure(run_dir or _run_dir_of_node(node_file), node_file.parent, nnodes, None)
        message = (
            f"rendezvous at {endpoint} failed for {what} within {rdzv_timeout_s:g} s "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        )
        _record_unmet(run_dir if nnodes > 1 and node_rank == 0 else None, message)
        raise UserError(message) from None
    finally:
        watchdog.cancel()
        rank_start.end_server(start)  # nothing of this node is left once its launcher has ended
        shutil.rmtree(node_file.parent, ignore_errors=True)
    state = _state(run_dir)
    return 1 if state == "failed" else EXIT_DIVERGED if state == DIVERGED else 0


def _raise_refusal(node_dir: Path, as_found: FolderAsFound) -> None:
    """A rank refused to run (bad input it found, ``failures.write_refusal``): its line, once, as the
    CLI says a ``UserError`` (exit 2), and the run folder as it was found."""
    line = refusal(node_dir)
    if line is not None:
        as_found.restore()
        if as_found.made_here and as_found.run_dir is not None and not as_found.run_dir.exists():
            os.environ.pop(RUN_DIR_ENV, None)
        raise UserError(line) from None


def _report_failure(run_dir: Path | None, node_dir: Path, nnodes: int, e: Any, nproc: int = 0) -> int:
    """The run failed (``e``: torch's ``ChildFailedError``, or None when the store went first): this
    node's notes into the run folder, the failure that caused the others on stderr; exit status 1."""
    cause = None
    deaths = rank_start.deaths(node_dir)  # forked ranks a signal killed: their supervisors' word
    if run_dir is not None and run_dir.is_dir():  # not on a node that does not share the runs folder
        try:
            # On one node the ranks are gone and their lock with them: a lock held now is another
            # run's, which writes this folder (a resume refused by a live run): write nothing into it.
            held = lock_run_folder(run_dir, wait_s=LOCK_WAIT_S) if nnodes == 1 else None
        except UserError as refused:
            print(f"multilane: error: {refused}", file=sys.stderr)
            return 2
        try:
            if e is not None:
                notes_from_child_failure(run_dir, e)
            for death in deaths:
                write_note(run_dir, death["rank"], death["message"], None, False, death["time"])
            if nnodes == 1 and e is not None:  # every rank is this node's: one without a note vanished
                note_silent_ranks(run_dir, nproc)
            # With several nodes the failure that caused this node's may be another node's: wait for its note.
            cause = consolidate(run_dir, wait_for_cause_s=FOREIGN_CAUSE_WAIT_S if nnodes > 1 else 0.0)
        except OSError as err:
            print(f"multilane: could not record the failure in {run_dir}: {err.strerror or err}", file=sys.stderr)
        finally:
            if held is not None:
                held.release(force=True)
    if cause:
        message = cause["message"]
    elif e is not None:
        message = first_failure(e, deaths)
    else:
        message = "the node holding the rendezvous store ended while the run trained"
    print(f"failed: {message}", file=sys.stderr)
    if run_dir is not None:
        print(f"  run directory: {run_dir}", file=sys.stderr)
    return 1


def _record_unmet(run_dir: Path | None, message: str) -> None:
    """Node 0 of several, in the folder made for it (``remote/multi_host.py``): the run never began;
    its status says so, so the folder does not look like a run that is about to start."""
    if run_dir is None or not run_dir.is_dir() or (run_dir / STATUS).exists():
        return
    try:
        rd = RunDir(run_dir)
        rd.set_status("failed", message, step=0)
        rd.close()
    except (OSError, UserError):
        pass


class RendezvousWatchdog:
    """Ends a launcher whose rendezvous neither completes nor fails in time, with one line.

    torch's c10d rendezvous gives up after ``join_timeout``, but not everywhere: a client that reaches
    a port held by something other than a c10d store (another program, a stale process) waits on its
    handshake forever. This thread waits ``timeout_s`` plus a grace period for the first worker process
    (they start once the rendezvous is complete); if none came, it prints the line and exits (2).
    """

    GRACE_S = 5.0

    def __init__(self, endpoint: str, what: str, timeout_s: float) -> None:
        self.endpoint, self.what, self.timeout_s = endpoint, what, timeout_s
        self.ranks_started = False  # seen once the rendezvous is complete
        self._done = threading.Event()
        threading.Thread(target=self._watch, name="rendezvous-watchdog", daemon=True).start()

    def cancel(self) -> None:
        self._done.set()

    def _watch(self) -> None:
        import psutil

        end = time.monotonic() + self.timeout_s + self.GRACE_S
        me = psutil.Process()
        while not self._done.wait(0.5):
            try:
                if any(_a_rank(c) for c in me.children(recursive=True)):
                    self.ranks_started = True
                    return  # the ranks started: the rendezvous is complete
            except psutil.Error:
                pass
            if time.monotonic() > end:
                print(
                    f"multilane: error: rendezvous at {self.endpoint} did not complete for {self.what} within "
                    f"{self.timeout_s:g} s (is something else listening on that port?)",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(2)


QUIET = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing.spawn")


def quiet_torch_loggers() -> None:
    """Silence the elastic agent's own log lines ("Received 15 death signal, shutting down workers",
    "Terminating process N via signal SIGTERM" as it stops the ranks after one failed).

    torch's ``get_logger`` sets a level on each module's logger (WARNING, from $LOGLEVEL), which
    overrides a level set on the parent: every logger already made under these names is set too."""
    for name in [*QUIET, *logging.root.manager.loggerDict]:
        if name.startswith(QUIET):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def first_failure(e: Any, deaths: list[dict[str, Any]] | None = None) -> str:
    """The message of the failure that caused the others among this node's ranks (no run folder known);
    ``deaths``: ranks a signal killed, which the agent may not have reported (``engine/start/ranks.py``)."""
    notes = list(deaths or [])
    for rank, f in e.failures.items():
        text = str(f.message.get("message", "")) if isinstance(f.message, dict) else ""
        lost = LOST_PEERS in text or bool(LOST_PEER_ERROR.search(text))
        if f.exitcode < 0:
            text = f"rank {rank} (pid {f.pid}) was killed by {f.signal_name()}"
        elif text.startswith(("RankFailed: ", f"{LOST_PEERS}: ")):
            text = text.split(": ", 1)[1]
        notes.append(
            {
                "rank": rank,
                "message": text or f"rank {rank} exited with {f.exitcode}",
                "lost_peers": lost,
                "time": f.timestamp,
            }
        )
    cause = primary(notes)
    return cause["message"] if cause else "a rank failed"


def _run_dir_of_node(node_file: Path) -> Path | None:
    """The run folder this node's ranks were told by rank 0 (several nodes: rank 0 made it)."""
    try:
        text = node_file.read_text().strip()
    except OSError:
        return None
    return Path(text) if text else None


def _state(run_dir: Path | None) -> str | None:
    if run_dir is None:
        return None
    try:
        return json.loads((run_dir / STATUS).read_text()).get("state")
    except (OSError, ValueError):
        return None


def _a_rank(process: Any) -> bool:
    """A rank, or the server that forks them (``engine/start/ranks.py``): either comes once the rendezvous is complete."""
    command = " ".join(process.cmdline())
    return "multilane.engine.cli" in command or "multiprocessing.forkserver" in command
