"""``multilane train --host A --host B ...``: one host as ``train --host`` always did, or one ddp run
across several (``remote/multi_host.py``), followed through host 0's run folder like a run on one host.

``--host HOST=DEVICES`` gives a host its own devices; ``--devices`` is the list of every host named
without ``=``. ``--remote-runs-dir`` once is every host's, or once per ``--host`` in the same order.
``--rdzv-endpoint ADDR[:PORT]`` names where the other hosts reach the first (default: the first host's
HostName and a port found free there).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from multilane.engine.errors import UserError


def cmd_train_hosts(args: argparse.Namespace) -> int:
    from multilane.engine.cli import remote
    from multilane.engine.remote.multi_host import parse_host_devices

    pairs = [parse_host_devices(h, args.devices) for h in args.host]
    runs_dirs = list(args.remote_runs_dir or [])
    if len(runs_dirs) not in (0, 1, len(pairs)):
        raise UserError(
            f"--remote-runs-dir is given {len(runs_dirs)} times for {len(pairs)} hosts: give it once (every host's) "
            "or once per --host"
        )
    if len(pairs) == 1:  # one host: `train --host` as before
        args.host, args.devices = pairs[0]
        args.remote_runs_dir = runs_dirs[0] if runs_dirs else None
        return remote.cmd_remote_train(args)
    return _train_across(args, pairs, runs_dirs)


def _train_across(args: argparse.Namespace, pairs: list[tuple[str, str | None]], runs_dirs: list[str]) -> int:
    from multilane.engine.cli import remote
    from multilane.engine.cli.train import _overrides
    from multilane.engine.remote.multi_host import Node, launch_multi_host, node_counts, wait_nodes_ended
    from multilane.engine.remote.remote_runs import FINAL, remote_status

    hosts = [h for h, _ in pairs]
    if args.strategy == "fsdp":
        raise UserError(
            "several --host with --strategy fsdp: every rank writes its shards into the run folder, which these "
            "hosts do not share; on a shared filesystem run `multilane train --strategy fsdp --nnodes N` on each"
        )
    if args.strategy not in (None, "ddp"):
        raise UserError(f"several --host make one ddp run; --strategy {args.strategy} cannot span hosts")
    if args.nnodes not in (1, len(pairs)):
        raise UserError(f"--nnodes {args.nnodes} with {len(pairs)} --host: the hosts are the nodes; leave it out")
    if args.node_rank is not None:
        raise UserError("--node-rank with several --host: the order of --host gives each node its place")
    for host, devices in pairs:
        if not devices:
            raise UserError(f"{host}: name its devices, with --devices LIST or --host {host}=LIST")
    addr, port = _endpoint(args.rdzv_endpoint)
    overrides = _overrides(args)
    overrides.pop("run.runs_dir", None)  # --runs-dir is where the mirror goes here
    overrides["devices.strategy"] = "ddp"
    config = None if args.resume else _configs(args, None, pairs, overrides)  # a resume's: once host 0 answers
    conns: list[Any] = []
    try:
        for host in hosts:  # every host answers before anything starts
            conns.append(remote.open_connection(args, host))
        resume, base = _resumed(conns[0], args.resume) if args.resume else (None, None)
        config = config or _configs(args, base, pairs, overrides)
        nodes = [
            Node(c, devices or "", runs_dirs[k] if len(runs_dirs) > 1 else (runs_dirs or [None])[0])
            for k, (c, (_, devices)) in enumerate(zip(conns, pairs, strict=True))
        ]
        if resume is not None:
            return _resume_across(args, conns[0], nodes, config.to_dict(), resume, overrides, (addr, port))
        launched = launch_multi_host(nodes, config.to_dict(), addr, port, args.rdzv_timeout)
        where = f"{launched.run.host}:{launched.run.path}"
        if args.detach:
            print(where)
            return 0
        across = node_counts([(h, d or "") for h, d in pairs])
        print(
            f"training on {where}: one ddp run across {across}, rendezvous at {launched.endpoint}; Ctrl+C stops it",
            file=sys.stderr,
        )
        local_runs = args.runs_dir or config.run.runs_dir
        code = remote._follow(conns[0], launched.run.path, local_runs, getattr(args, "interval", 0.5), launched.run)
        if (remote_status(conns[0], launched.run.path) or {}).get("state") in FINAL:  # not left training
            wait_nodes_ended(launched.nodes, conns)
        return code
    finally:
        for c in conns:
            c.close()


def _resumed(conn: Any, path: str) -> tuple[str, dict[str, Any]]:
    """``--resume RUN`` across hosts: RUN, a run folder on the first host (its absolute path), and the
    config it was started with (its ``config.json``), which the other nodes start from."""
    import json

    from multilane.engine.display.terminal_text import printable
    from multilane.engine.remote.launch import absolute_there
    from multilane.engine.remote.remote_runs import refuse_live
    from multilane.engine.rundir.runlog import CONFIG

    folder = absolute_there(conn, path)
    if folder is None:
        raise UserError(f"--resume: {printable(conn.name)}:{printable(path)} is not a folder there (the first --host)")
    refuse_live(conn, folder)
    try:
        with conn.lock, conn.sftp().open(f"{folder}/{CONFIG}", "r") as f:
            base = json.loads(f.read(1 << 20))
            conn.sftp().stat(f"{folder}/checkpoints/last.pt")
    except (OSError, ValueError) as e:
        raise UserError(
            f"--resume: {printable(conn.name)}:{printable(folder)} is not a run with a checkpoint there "
            f"({printable(str(e)) or type(e).__name__})"
        ) from None
    if not isinstance(base, dict):
        raise UserError(f"--resume: {printable(conn.name)}:{printable(folder)}/{CONFIG} is not a run's config")
    return folder, base


def _configs(
    args: argparse.Namespace, base: dict[str, Any] | None, pairs: list[tuple[str, str | None]], overrides: dict
) -> Any:
    """Host 0's config; every host's device list is checked here, before anything starts anywhere."""
    configs = []
    for _, devices in pairs:
        overrides["devices.use"] = devices
        configs.append(_node_config(args, base, dict(overrides)))
    return configs[0]


def _node_config(args: argparse.Namespace, base: dict[str, Any] | None, overrides: dict[str, Any]) -> Any:
    """A node's config: the flags' (a new run), or the resumed run's config with the flags over it."""
    from multilane.engine.cli.train import _run_config
    from multilane.engine.config import build_config, merge

    if base is None:
        return _run_config(argparse.Namespace(**{**vars(args), "resume": None}), overrides)
    overrides.pop("task.params", None)
    return build_config(merge(base, overrides), "--resume config")


def _resume_across(
    args: argparse.Namespace, conn: Any, nodes: list[Any], config: dict[str, Any], folder: str,
    overrides: dict[str, Any], endpoint: tuple[str | None, int | None],
) -> int:  # fmt: skip
    """The run in ``folder`` on host 0 continued across ``nodes`` and followed to its end, as
    ``train --host H --resume`` follows one host's (the curves so far, then the new steps)."""
    from multilane.engine.cli import remote
    from multilane.engine.display.terminal_text import printable
    from multilane.engine.remote.mirror import mirror_folder
    from multilane.engine.remote.multi_host import launch_multi_host, wait_nodes_ended
    from multilane.engine.remote.remote_runs import FINAL, remote_status, resume_followed

    flags = {k: v for k, v in overrides.items() if k not in ("task.params", "devices.use", "devices.strategy")}
    launched: list[Any] = []

    def start() -> Any:
        launched.append(
            launch_multi_host(
                nodes, config, endpoint[0], endpoint[1], args.rdzv_timeout, resume=folder, overrides=flags
            )
        )
        return launched[0].run

    if args.detach:
        print(printable(f"{conn.name}:{start().path}"))
        return 0
    local = mirror_folder(args.runs_dir or "runs", conn.spec.label, folder)
    run, follower = resume_followed(conn, folder, local, start=start)
    print(printable(f"resuming {conn.name}:{run.path} across {len(nodes)} hosts; Ctrl+C stops it"), file=sys.stderr)
    code = remote._watch_remote(conn, folder, follower, getattr(args, "interval", 0.5))
    if (remote_status(conn, folder) or {}).get("state") in FINAL:
        wait_nodes_ended(launched[0].nodes, [n.conn for n in nodes])
    return code


def _endpoint(text: str | None) -> tuple[str | None, int | None]:
    """``ADDR`` or ``ADDR:PORT`` (IPv6 in brackets): where the other hosts reach the first."""
    if not text:
        return None, None
    addr, sep, port = text.rpartition(":")
    if not sep or (addr.count(":") and not addr.endswith("]")):  # no port (a bare IPv6 address is all address)
        addr, port = text, ""
    addr = addr.strip("[]")
    if not addr or (port and (not port.isdigit() or not 0 < int(port) < 65536)):
        raise UserError(f"--rdzv-endpoint {text!r}: expected ADDR or ADDR:PORT, the first host as the others reach it")
    return addr, int(port) if port else None
