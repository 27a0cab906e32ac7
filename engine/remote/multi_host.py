"""One ddp run across several hosts: a launcher on each (``multilane train --strategy ddp --nnodes N
--node-rank K``), the rendezvous on the first.

Host 0 holds everything the user looks at: the rendezvous (its store, at the first host's address as
the others reach it and a port found free there), global rank 0 (its first rank: the launchers use
torch's static rendezvous, so the node order is the order the user gave, not the host names'), and
THE run folder, made here over SFTP before anything starts and handed to its launcher through
``MULTILANE_RUN_DIR``, so the mirror follows a folder known from the start. The other hosts' launchers
make no run folder: their config and console go in ``<runs>/.multilane-nodes/<id>-node<K>/`` (hidden,
no metrics: no runs table lists it as a run).

A node that cannot be reached, has no (or another) ``multilane``, or cannot be started: one line, and
every launcher already started is killed (its whole session) and host 0's unused run folder removed.
A node that starts and then never meets the others: every launcher gives up after ``rdzv_timeout_s``
(node 0's run folder then says "failed" with the rendezvous line). Stop and pause go through host 0's
control file: rank 0 reads it and every rank agrees on the same step, on every host.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import posixpath
import shlex
import uuid
from dataclasses import dataclass, field
from typing import Any

from multilane.engine.remote.connection import Connection, RemoteError
from multilane.engine.remote.launch import (
    RemoteRun,
    _line,
    _start,
    make_run_folder,
    remote_runs_folder,
    set_flags,
)
from multilane.engine.rundir.runlog import CONFIG

NODES_FOLDER = ".multilane-nodes"  # in a host's runs folder: the other nodes' config and console
DEFAULT_RDZV_TIMEOUT_S = 60.0
# The python that runs the remote multilane (its script's #! line), else python3: a port free there.
NODES_FILE = "nodes.json"  # in host 0's run folder: every node's host (failures.py reads it)
_FREE_PORT = (
    'for py in "$(sed -n \'1s/^#![[:space:]]*//p\' "$(command -v {cmd})" 2>/dev/null)" python3 python; do '
    '[ -n "$py" ] && $py -c \'import socket;s=socket.socket();s.bind(("",0));print(s.getsockname()[1])\' '
    "2>/dev/null && exit 0; done; exit 1"
)


@dataclass
class Node:
    """One host of the run: its connection, its devices (``cpu:0,cpu:1``, ``cuda:0``...), its runs folder."""

    conn: Connection
    devices: str
    runs_dir: str | None = None
    folder: str = ""  # there: the run folder (node 0) or its node folder
    pid: int | None = None


@dataclass
class MultiHostRun:
    """The run (host 0's folder, mirrored and followed) and every node's launcher."""

    run: RemoteRun
    nodes: list[RemoteRun] = field(default_factory=list)
    endpoint: str = ""
    rdzv_id: str = ""


def parse_host_devices(text: str, default: str | None) -> tuple[str, str | None]:
    """``HOST`` or ``HOST=DEVICES`` (``=`` is in no host name): the host and its devices (or ``default``)."""
    host, sep, devices = text.partition("=")
    host, devices = host.strip(), devices.strip()
    if not host:
        raise RemoteError(f"--host {text!r}: expected HOST or HOST=DEVICES, e.g. gpu1=cuda:0,cuda:1")
    if sep and not devices:
        raise RemoteError(f"--host {text!r}: no devices after '='; e.g. {host}=cuda:0,cuda:1")
    return host, devices if sep else default


def rendezvous_address(nodes: list[Node], override: str | None = None) -> str:
    """Where the other hosts reach the first: ``override``, else the first host's HostName (ssh config).

    A loopback name is refused when another host is a different machine: it would reach itself."""
    addr = override or nodes[0].conn.hostname
    if override is None and _loopback(addr) and any(not _loopback(n.conn.hostname) for n in nodes[1:]):
        raise RemoteError(
            f"{nodes[0].conn.name}: its address {addr!r} is a loopback address the other hosts cannot reach; "
            "give the address they reach it at with --rdzv-endpoint ADDR"
        )
    return addr


def free_port_there(conn: Connection) -> int:
    """A TCP port free on the host now (found there, by the python that runs its multilane)."""
    code, out, err = conn.run(_FREE_PORT.format(cmd=shlex.quote(conn.remote_command)))
    text = out.strip().splitlines()[-1] if out.strip() else ""
    if code != 0 or not text.isdigit():
        raise RemoteError(
            f"{conn.name}: could not find a free port there for the rendezvous ({_line(err) or code}); "
            "give one with --rdzv-endpoint ADDR:PORT"
        )
    return int(text)


def launch_multi_host(
    nodes: list[Node],
    config: dict[str, Any],
    rdzv_addr: str | None = None,
    rdzv_port: int | None = None,
    rdzv_timeout_s: float = DEFAULT_RDZV_TIMEOUT_S,
    resume: str | None = None,
    overrides: dict[str, Any] | None = None,
) -> MultiHostRun:
    """Start one ddp run of ``config`` (a ``RunConfig.to_dict()``) across ``nodes``; returns at once.

    ``resume``: the run folder on host 0 to continue instead (``config``: its config, ``overrides``
    applied). Node 0 resumes it there (``--resume``, ``overrides`` as ``--set``); the other nodes start
    from ``config`` with their own devices and get rank 0's checkpoint when the ranks set up (they hold
    no copy of the run folder)."""
    if len(nodes) < 2:
        raise RemoteError("a run across hosts needs at least two hosts")
    names = [n.conn.name for n in nodes]
    twice = sorted({h for h in names if names.count(h) > 1})
    if twice:
        raise RemoteError(f"{twice[0]} is named twice; give each host once, with all its devices")
    for n in nodes:
        if not n.devices or n.devices.strip().lower() == "auto":
            raise RemoteError(f"{n.conn.name}: name its devices (e.g. {n.conn.name}=cuda:0,cuda:1), not 'auto'")
    runs = []
    for n in nodes:  # every host answers, with this multilane, before anything starts anywhere
        n.conn.check_multilane()
        runs.append(remote_runs_folder(n.conn, n.runs_dir))
    addr = rendezvous_address(nodes, rdzv_addr)
    port = rdzv_port or free_port_there(nodes[0].conn)
    endpoint = f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"
    rdzv_id = f"multilane-{uuid.uuid4().hex[:12]}"
    name = config["run"]["name"]
    started: list[Node] = []
    try:
        for k, (n, r) in enumerate(zip(nodes, runs, strict=True)):
            if k == 0:
                n.folder = resume or make_run_folder(n.conn, r, name)
                _write_nodes(n.conn, n.folder, nodes)
            else:
                n.folder = posixpath.join(r, NODES_FOLDER, f"{rdzv_id}-node{k}")
                code, _, err = n.conn.run(f"mkdir -p -- {shlex.quote(n.folder)}", login=False)
                if code != 0:
                    raise RemoteError(f"{n.conn.name}: cannot make {n.folder} there ({_line(err) or code})")
            node_config = {
                **config,
                "run": {**config["run"], "runs_dir": r},
                "devices": {**config.get("devices", {}), "use": n.devices, "strategy": "ddp", "weights": []},
            }
            if k == 0 and resume:
                start = ["--resume", n.folder, "--devices", n.devices, *set_flags(overrides or {})]
            else:
                start = ["--config", posixpath.join(n.folder, CONFIG)]
                with n.conn.lock, n.conn.sftp().open(start[1], "w") as f:
                    f.write(json.dumps(node_config, indent=2) + "\n")
            args = [
                *start, "--strategy", "ddp", "--nnodes", str(len(nodes)), "--node-rank", str(k),
                "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id, "--rdzv-timeout", f"{rdzv_timeout_s:g}",
            ]  # fmt: skip
            started.append(n)
            n.pid = _start(n.conn, n.folder, " ".join(shlex.quote(a) for a in args), made=k == 0 and not resume)
            if n.pid is None:
                raise RemoteError(f"{n.conn.name}: the launcher started but gave no process id")
    except Exception as e:
        stop_nodes(started)
        if nodes[0].folder and not resume:  # never the run being resumed
            remove_unused_folder(nodes[0].conn, nodes[0].folder)
        if isinstance(e, RemoteError):
            raise
        raise RemoteError(f"{started[-1].conn.name if started else names[0]}: could not start the run ({e})") from None
    run0 = nodes[0]
    run = RemoteRun(run0.conn.name, run0.folder, run0.pid, run0.conn.remote_command)
    run.nodes = [{"host": n.conn.name, "path": n.folder, "pid": n.pid, "devices": n.devices} for n in nodes]
    launched = [RemoteRun(n.conn.name, n.folder, n.pid, n.conn.remote_command) for n in nodes]
    return MultiHostRun(run, launched, endpoint, rdzv_id)


def _write_nodes(conn: Connection, folder: str, nodes: list[Node]) -> None:
    """``nodes.json`` in host 0's run folder: each node's host, address and devices, so that the run's
    own record can name a node it lost (``engine/distributed/failures.py``)."""
    body = [
        {"node": k, "host": n.conn.name, "address": n.conn.hostname, "devices": n.devices} for k, n in enumerate(nodes)
    ]
    with conn.lock, conn.sftp().open(posixpath.join(folder, NODES_FILE), "w") as f:
        f.write(json.dumps({"nodes": body}, indent=2) + "\n")


def stop_nodes(nodes: list[Node]) -> None:
    """Kill every started launcher's whole session there (setsid: its pid is its process group)."""
    for n in nodes:
        if n.pid is None:
            continue
        # The launcher's group, or its pid alone while it is still the subshell that will become it (a stop
        # right after the start can land before setsid): SIGTERM for a second, then SIGKILL, until neither is there.
        pid, pg = int(n.pid), shlex.quote(f"-{int(n.pid)}")
        kill = (
            f"i=0; while kill -0 {pid} 2>/dev/null || kill -0 -- {pg} 2>/dev/null; do "
            f"s=TERM; [ $i -ge 10 ] && s=KILL; kill -$s -- {pg} 2>/dev/null; kill -$s {pid} 2>/dev/null; "
            f"i=$((i+1)); [ $i -ge 100 ] && break; sleep 0.1; done; true"
        )
        with contextlib.suppress(RemoteError):
            n.conn.run(kill, login=False, timeout_s=30)


def wait_nodes_ended(nodes: list[RemoteRun], conns: list[Connection], timeout_s: float = 30.0) -> None:
    """After the run has ended: wait, up to ``timeout_s`` on each host, until each node's launcher session
    is gone there (setsid: its pid is its process group), so that nothing of the run is left on any
    host when ``train --host A --host B`` returns. The run's own record was the news already: a host
    that does not answer, or a session still ending after the wait, changes nothing of it."""
    rounds = max(1, int(timeout_s / 0.1))
    for n, conn in zip(nodes, conns, strict=False):
        if n.pid is None:
            continue
        pid, pg = int(n.pid), shlex.quote(f"-{int(n.pid)}")
        alive = f"kill -0 {pid} 2>/dev/null || kill -0 -- {pg} 2>/dev/null"
        wait = f"i=0; while {alive}; do [ $i -ge {rounds} ] && exit 0; i=$((i+1)); sleep 0.1; done"
        with contextlib.suppress(RemoteError):
            conn.run(wait, login=False, timeout_s=timeout_s + 15)


def remove_unused_folder(conn: Connection, folder: str) -> None:
    """Host 0's run folder, made for a run that never started (no metrics): it would say a run is coming."""
    q = shlex.quote(folder)
    with contextlib.suppress(RemoteError):
        conn.run(f"test -e {q}/metrics.jsonl || rm -rf -- {q}", login=False)


def node_counts(pairs: list[tuple[str, str]]) -> str:
    """ "A (2 devices) and B (1 device)": the line's words for hosts and their device lists."""
    parts = []
    for host, devices in pairs:
        n = len([d for d in devices.split(",") if d.strip()])
        parts.append(f"{host} ({n} device{'' if n == 1 else 's'})")
    return ", ".join(parts[:-1]) + f" and {parts[-1]}" if len(parts) > 1 else "".join(parts)


def _loopback(addr: str) -> bool:
    if addr.lower() in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(addr.strip("[]")).is_loopback
    except ValueError:
        return False
