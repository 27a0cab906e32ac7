"""Lost trials: a trial whose process, or whose worker, died without recording an end (kill -9, out of
memory, a machine that went down) is recorded failed with the user attribute ``lost``, does not count,
and its parameters are enqueued again; its run folder's status says it was lost, never "running".

``recover_lost(sweep)`` is what the CLI (``sweep --resume``, ``sweep-worker``, each sweep's start) and the
app (opening a sweep) run. It judges only trials of this machine, and never one that is being asked:
``study.ask()`` makes a trial RUNNING before its worker's identity is written into it, so the ask and
the identity are written under a lock of this machine (``asking``) that ``recover_lost`` also holds.
A RUNNING trial without an identity is then either another machine's, in that short window, or one
whose asker died in it: it is judged lost at once for a journal (a file of this machine: every worker
is here), and for a database once it has been RUNNING for ``NO_IDENTITY_GRACE_S``."""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
from multilane.engine.sweep.optuna_lib import optuna

NO_IDENTITY_GRACE_S = 120.0
MAX_TIMES_LOST = 3  # the same parameters lost this often (an out-of-memory every time): failed, counted
LOST_STATE = "aborted"


@contextlib.contextmanager
def asking() -> Iterator[None]:
    """This machine's lock (per user) around asking a trial and writing who runs it, and around
    ``recover_lost``: another worker here never sees a trial between the two."""
    path = Path(tempfile.gettempdir()) / f"multilane-sweep-ask-{os.getuid()}.lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError:  # a /tmp that takes no files: no lock (workers of one machine may race, as before)
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # drops the lock


def worker_identity(name: str | None = None) -> dict[str, Any]:
    """Who runs a trial: this host and process (its start time, so a reused pid is not taken for it), and
    the worker's name as the user knows the machine (``--worker-name``: the app passes the SSH host's name)."""
    host = socket.gethostname()
    return {
        "host": host,
        "worker": name or host,
        "worker_pid": os.getpid(),
        "worker_started": psutil.Process().create_time(),
    }


def recover_lost(sweep: Any, grace_s: float = NO_IDENTITY_GRACE_S) -> list[int]:
    """Trials RUNNING in ``sweep``'s study whose worker on this machine is gone: recorded failed (``lost``),
    their parameters enqueued again, their run folders' status set to what happened. Returns their numbers.
    The app calls this when it opens a sweep, as ``multilane sweep --resume`` does."""
    ts = optuna().trial.TrialState
    lost = []
    host = socket.gethostname()
    local = sweep.storage_url is None  # a journal: every worker of the study runs on this machine
    with asking():
        for t in sweep.study.get_trials(deepcopy=False, states=(ts.RUNNING,)):
            a = t.user_attrs
            if "worker_pid" not in a:  # being asked right now elsewhere, or its asker died while asking
                if not local and _age_s(t) < grace_s:
                    continue
            elif a.get("host") != host or _alive(a.get("worker_pid"), a.get("worker_started")):
                continue  # another machine's trial, or a live worker's: not ours to judge
            fail_and_requeue(sweep, t, "its worker process is gone (killed?)", killed=True)
            lost.append(t.number)
    return lost


def fail_and_requeue(sweep: Any, trial: Any, why: str, killed: bool = False) -> None:
    """Record a trial that did not end on its own as failed (``lost``: it does not count) and enqueue its
    parameters again. ``killed``: its process died; after ``MAX_TIMES_LOST`` such deaths of the same
    parameters the trial is an ordinary failure instead (counted, not re-queued)."""
    storage = sweep.study._storage
    times = int(trial.user_attrs.get("times_lost", 0)) + (1 if killed else 0)
    run_dir = trial.user_attrs.get("run_dir")
    if run_dir:
        mark_run_lost(Path(run_dir), why)
    if killed and times >= MAX_TIMES_LOST:
        storage.set_trial_user_attr(trial._trial_id, "error", f"lost {times} times ({why}); not re-queued again")
        storage.set_trial_state_values(trial._trial_id, optuna().trial.TrialState.FAIL)
        return
    storage.set_trial_user_attr(trial._trial_id, "lost", why)
    storage.set_trial_state_values(trial._trial_id, optuna().trial.TrialState.FAIL)
    if trial.params:
        attrs = {"requeued_from": trial.number, "times_lost": times}
        sweep.study.enqueue_trial(dict(trial.params), user_attrs=attrs)


def mark_run_lost(run_dir: Path, why: str) -> None:
    """A lost trial's run folder: its status, still "running" (or never written) because its process
    died without an end, becomes ``aborted`` saying so. A folder whose process still holds its lock, or
    whose status is already an end, is left alone."""
    from multilane.engine.rundir.follow import TERMINAL_STATES
    from multilane.engine.rundir.run_lock import lock_is_held
    from multilane.engine.rundir.runlog import STATUS
    from multilane.engine.rundir.writefile import atomic_write_bytes

    if not run_dir.is_dir() or lock_is_held(run_dir):
        return
    try:
        status = json.loads((run_dir / STATUS).read_text(encoding="utf-8"))
        status = status if isinstance(status, dict) else {}
    except (OSError, ValueError):
        status = {}
    if status.get("state") in TERMINAL_STATES:
        return
    status.update(
        state=LOST_STATE,
        message=f"lost: {why}; it recorded no end, and the sweep re-queued its parameters",
        updated=time.time(),
    )
    with contextlib.suppress(OSError):
        atomic_write_bytes(run_dir / STATUS, (json.dumps(status, indent=2) + "\n").encode())


def _age_s(trial: Any) -> float:
    start = trial.datetime_start
    if start is None:
        return 0.0
    now = datetime.datetime.now(start.tzinfo) if start.tzinfo else datetime.datetime.now()
    return (now - start).total_seconds()


def _alive(pid: Any, started: Any) -> bool:
    if not isinstance(pid, int):
        return False
    try:
        p = psutil.Process(pid)
        return started is None or abs(p.create_time() - float(started)) < 1.0
    except (psutil.Error, ValueError, TypeError):
        return False
