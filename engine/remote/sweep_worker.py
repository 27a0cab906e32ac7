"""A sweep's worker on a host: ``multilane sweep-worker`` started detached there over SSH, in its own
session, adding the host's slots to a study in a shared RDB storage; stopped, and asked whether it runs.

Every value reaches the host as data, never as shell (``shlex.quote`` around each, as launch.py does).
The storage URL usually holds the database's password, so it is in no command line there (``ps`` shows
every user's), no environment, no file and no log: the shell line sent reads it from its standard input
(the SSH channel) and hands it on through a pipe from the shell's own ``printf`` (a builtin: no process
of its own) to ``multilane sweep-worker --storage -``, which reads it from its standard input.
"""

from __future__ import annotations

import posixpath
import re
import shlex
import time
from dataclasses import dataclass
from urllib.parse import unquote

from multilane.engine.errors import UserError
from multilane.engine.remote.connection import Connection, RemoteError
from multilane.engine.remote.launch import _line, remote_runs_folder

DEFAULT_SWEEPS = "sweeps"  # on the host, in the login's home: the worker's trial folders go in <it>/<study>
STOP_GRACE_S = 120.0  # running trials finish their step and write a checkpoint before the worker exits

NOT_SHAREABLE = (
    "a worker on a host needs the sweep's study in an RDB storage the host can reach (--storage "
    "postgresql+psycopg://USER:PASSWORD@DBHOST/DB); {what} is a file on this computer only"
)


@dataclass
class RemoteWorker:
    """A ``sweep-worker`` on a host: its pid there (also its session's id) and its console log."""

    host: str
    pid: int
    log: str
    study: str
    devices: str


def check_shareable(storage: str | None) -> str:
    """``storage`` when workers on other machines can share it; one line saying why not otherwise."""
    url = (storage or "").strip()
    if not url:
        raise UserError(NOT_SHAREABLE.format(what="the sweep folder's study.journal"))
    if url.lower().startswith("sqlite:"):
        raise UserError(NOT_SHAREABLE.format(what=f"{hide_password(url)} (SQLite)"))
    if "://" not in url:
        raise UserError(NOT_SHAREABLE.format(what=f"{url!r} (a journal file)"))
    return url


_PASSWORD = re.compile(r"^(?P<head>[^:/]+://[^:@/]*:)(?P<pw>[^@/]*)(?P<tail>@.*)$", re.S)


def hide_password(url: str) -> str:
    """``scheme://user:***@host/db``: a URL as it may be shown."""
    m = _PASSWORD.match(url)
    return f"{m['head']}***{m['tail']}" if m and m["pw"] else url


def redact(text: str, url: str | None) -> str:
    """``text`` with the URL's password (as written and URL-decoded) replaced by ``***``."""
    m = _PASSWORD.match(url or "")
    if not m or not m["pw"]:
        return text
    for secret in {m["pw"], unquote(m["pw"])}:
        if secret:
            text = text.replace(secret, "***")
    return text


def start_worker(
    conn: Connection,
    storage: str,
    study: str,
    devices: str,
    per_trial: int | None = None,
    sweeps_dir: str | None = None,
    name: str | None = None,
) -> RemoteWorker:
    """Start ``multilane sweep-worker`` for ``study`` on the host's ``devices``; returns at once."""
    url = check_shareable(storage)
    conn.check_multilane()
    folder = remote_runs_folder(conn, sweeps_dir or DEFAULT_SWEEPS)
    label = re.sub(r"[^A-Za-z0-9._-]+", "_", study)[:80] or "study"
    log = posixpath.join(folder, f"sweep-worker-{label}-{time.strftime('%Y%m%d-%H%M%S')}-{time.time_ns() % 10**6}.log")
    args = ["sweep-worker", "--storage", "-", "--study", study, "--devices", devices, "--sweeps-dir", folder]
    args += ["--no-table"]
    args += ["--worker-name", name or conn.name]
    if per_trial:
        args += ["--per-trial", str(per_trial)]
    q = shlex.quote
    # `exec` in the pipeline's last part: $! is then the worker itself, and setsid (not a group leader
    # there) makes it the leader of a new session whose id is that pid, which stop_worker signals.
    line = (
        f"IFS= read -r u || exit 3; cd -- {q(folder)} || exit 4; "
        f"printf '%s\\n' \"$u\" | exec setsid {q(conn.remote_command)} {' '.join(q(a) for a in args)}"
        f" >> {q(log)} 2>&1 & echo $!"
    )
    code, out, err = conn.run(line, stdin=url + "\n")
    pid = out.strip().splitlines()[-1] if out.strip() else ""
    if code != 0 or not pid.isdigit():
        raise RemoteError(f"{conn.name}: could not start the sweep-worker ({redact(_line(err), url) or code})")
    return RemoteWorker(conn.name, int(pid), log, study, devices)


def worker_running(conn: Connection, pid: int) -> bool:
    """True while any process of the worker's session (the worker, its trials) runs on the host."""
    pid = int(pid)
    # procps selects by session; a ps without -s (not Linux) falls back to the worker alone
    _, out, _ = conn.run(
        f"ps -o pid= -s {pid} 2>/dev/null || {{ kill -0 {pid} 2>/dev/null && echo {pid}; }}", login=False
    )
    return bool(out.strip())


def stop_worker(conn: Connection, pid: int, grace_s: float = STOP_GRACE_S) -> bool:
    """Stop the worker as Ctrl+C would: its running trials stop with a checkpoint and are recorded failed
    and re-queued in the study. Past ``grace_s``, its whole session is killed. True when nothing of it runs."""
    conn.run(f"kill -TERM {int(pid)}", login=False)  # the worker only: it stops its trials itself
    end = time.monotonic() + grace_s
    while worker_running(conn, pid):
        if time.monotonic() > end:
            conn.run(f"kill -KILL -- -{int(pid)}", login=False)  # setsid made it a process group too
            time.sleep(1.0)
            return not worker_running(conn, pid)
        time.sleep(0.5)
    return True


def read_log(conn: Connection, path: str, offset: int = 0) -> tuple[str, int]:
    """What the worker's console log holds past ``offset``, and the new offset."""
    with conn.lock:
        try:
            with conn.sftp().open(path, "rb") as f:
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            return "", offset
    return data.decode("utf-8", "replace"), offset + len(data)
