"""Starting a run on a host: ``multilane train`` detached there, in its own session, so that it
survives the window closing and the connection dropping.

Every value the user gave reaches the host as data, never as shell: the config travels as a JSON file
(SFTP), folders are made over SFTP, and the one command line sent is built with ``shlex.quote``
around every path and the command's name. A runs folder named ``a b; $(rm -rf x)`` is a folder.
"""

from __future__ import annotations

import json
import posixpath
import shlex
import time
from dataclasses import dataclass, field
from typing import Any

from multilane.engine.display.terminal_text import printable
from multilane.engine.distributed import RUN_DIR_ENV
from multilane.engine.remote.connection import Connection, RemoteError
from multilane.engine.rundir.runlog import CONFIG

CONSOLE = "console.log"
DEFAULT_REMOTE_RUNS = "runs"  # relative to the login's home, where ssh starts


@dataclass
class RemoteRun:
    """A run on a host: where its folder is there, and the process that trains it."""

    host: str
    path: str
    pid: int | None = None
    remote_command: str = "multilane"
    nodes: list[dict[str, Any]] = field(default_factory=list)  # a run across hosts: each node's launcher


def absolute_there(conn: Connection, path: str) -> str | None:
    """``path`` on the host (``~/...`` and relative paths from the login's home) as an absolute path with
    its links resolved, or None when no folder is there. Read over SFTP (``realpath``), a length-prefixed
    string: byte for byte, a newline in a folder's name included (no shell output parsed by lines)."""
    import stat

    from multilane.engine.remote.connection import Disconnected
    from multilane.engine.remote.ssh import paramiko

    if path == "~":
        path = "."
    elif path.startswith("~/"):  # the home is where SFTP starts; quoting would keep "~" literal
        path = path[2:] or "."
    pm = paramiko()
    try:
        with conn.lock:
            sftp = conn.sftp()
            try:
                if not stat.S_ISDIR(int(sftp.stat(path).st_mode or 0)):
                    return None
                real = sftp.normalize(path)
            except OSError:
                return None
    except (EOFError, pm.SSHException) as e:
        conn.close()
        raise Disconnected(f"{conn.name}: the connection dropped ({e or type(e).__name__})") from None
    return real if real.startswith("/") else None


def remote_runs_folder(conn: Connection, runs_dir: str | None) -> str:
    """The host's runs folder as an absolute path, made when missing."""
    runs = runs_dir or DEFAULT_REMOTE_RUNS
    there = (runs[2:] or ".") if runs.startswith("~/") else "." if runs == "~" else runs
    code, _, err = conn.run(f"mkdir -p -- {shlex.quote(there)}", login=False)
    path = absolute_there(conn, runs) if code == 0 else None
    if path is None:
        raise RemoteError(
            f"{conn.name}: cannot use the runs folder {printable(repr(runs_dir))} there ({printable(_line(err)) or code})"
        )
    return path


def make_run_folder(conn: Connection, runs: str, name: str) -> str:
    """A new ``<runs>/<timestamp>-<name>`` on the host (exclusive, as ``RunDir.create`` locally)."""
    sftp = conn.sftp()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for i in range(1000):
        path = posixpath.join(runs, f"{stamp}-{name}" if i == 0 else f"{stamp}-{name}-{i + 1}")
        try:
            sftp.mkdir(path)
        except OSError:
            try:
                sftp.stat(path)
            except OSError:
                raise RemoteError(f"{conn.name}: cannot create a run folder in {runs}") from None
            continue  # taken: the next name
        sftp.mkdir(posixpath.join(path, "checkpoints"))
        return path
    raise RemoteError(f"{conn.name}: too many runs named {name!r} this second in {runs}")


def _start(conn: Connection, folder: str, train_args: str, made: bool) -> int | None:
    """``multilane train ARGS`` in its own session there; its pid."""
    from multilane.integrations.mlflow_records import MIRROR_ENV

    q = shlex.quote(folder)
    # MIRROR_ENV: an MLflow server this host does not reach is handed to the mirror (mlflow_logger.py)
    env = f"env {MIRROR_ENV}=1 {RUN_DIR_ENV}={q} " if made else f"env {MIRROR_ENV}=1 "
    # ``exec`` in the subshell: its pid ($!) becomes setsid, then the launcher, whose session and process
    # group it leads. Without it bash (a host whose sh is bash) forks setsid as the subshell's child, and
    # the group that stop and wait address (-$!) would not be the launcher's.
    line = (
        f"(cd -- {q} && exec {env}setsid {shlex.quote(conn.remote_command)} train {train_args})"
        f" < /dev/null >> {shlex.quote(posixpath.join(folder, CONSOLE))} 2>&1 & echo $!"
    )
    code, out, err = conn.run(line)
    if code != 0:
        raise RemoteError(f"{conn.name}: could not start the run ({_line(err) or code})")
    pid = out.strip().splitlines()[-1] if out.strip() else ""
    return int(pid) if pid.isdigit() else None


def launch_run(conn: Connection, config: dict[str, Any], runs_dir: str | None = None) -> RemoteRun:
    """Start a new run of ``config`` (a ``RunConfig.to_dict()``) on the host; returns at once."""
    conn.check_multilane()
    runs = remote_runs_folder(conn, runs_dir)
    folder = make_run_folder(conn, runs, config["run"]["name"])
    config = {**config, "run": {**config["run"], "runs_dir": runs}}
    with conn.lock, conn.sftp().open(posixpath.join(folder, CONFIG), "w") as f:
        f.write(json.dumps(config, indent=2) + "\n")
    pid = _start(conn, folder, f"--config {shlex.quote(posixpath.join(folder, CONFIG))}", made=True)
    return RemoteRun(conn.name, folder, pid, conn.remote_command)


def set_flags(overrides: dict[str, Any]) -> list[str]:
    """``--set KEY=VALUE`` for each override, as the host's ``multilane train`` reads them back."""
    out = []
    for key, value in overrides.items():
        out += ["--set", f"{key}={value if isinstance(value, str) else json.dumps(value)}"]
    return out


def resume_run(conn: Connection, folder: str, overrides: dict[str, Any] | None = None) -> RemoteRun:
    """Continue the run in the host's ``folder`` from its last checkpoint (refused while it is live there:
    the launcher there would refuse it too, but only into its console.log, detached)."""
    from multilane.engine.remote.remote_runs import refuse_live

    conn.check_multilane()
    refuse_live(conn, folder)
    args = ["--resume", folder, *set_flags(overrides or {})]
    code, _, _ = conn.run(f"test -f {shlex.quote(posixpath.join(folder, 'checkpoints', 'last.pt'))}", login=False)
    if code != 0:
        raise RemoteError(f"{conn.name}: {folder} has no checkpoint to resume from")
    pid = _start(conn, folder, " ".join(shlex.quote(a) for a in args), made=False)
    return RemoteRun(conn.name, folder, pid, conn.remote_command)


def write_remote_control(conn: Connection, folder: str, command: str) -> None:
    """Pause, resume or stop the run in the host's ``folder`` through its control file (written whole,
    then renamed over the old one, as ``write_control`` does locally)."""
    from multilane.engine.rundir.control_file import COMMANDS, CONTROL

    if command not in COMMANDS:
        raise RemoteError(f"control: unknown command {command!r}; use {', '.join(COMMANDS)}")
    path = posixpath.join(folder, CONTROL)
    tmp = posixpath.join(folder, f".{CONTROL}.{time.monotonic_ns()}.tmp")
    with conn.lock:
        sftp = conn.sftp()
        with sftp.open(tmp, "w") as f:
            f.write(json.dumps({"command": command, "time": time.time(), "host": "remote"}) + "\n")
        sftp.posix_rename(tmp, path)


def _line(text: str) -> str:
    lines = [s for s in text.strip().splitlines() if s.strip()]
    return lines[-1] if lines else ""
