"""The CLI on a host over SSH: ``devices --host``, ``train --host`` and ``watch HOST:RUN_DIR``.

``train --host`` starts the run detached on the host (it survives this command, the terminal and the
connection); without ``--detach`` it mirrors the run folder under the local runs folder and shows
the progress line as ``watch`` does, and Ctrl+C asks the run there to stop (a second Ctrl+C leaves
it training and returns).
"""

from __future__ import annotations

import argparse
import getpass
import json
import sys
from typing import Any

from multilane.engine.display.terminal_text import printable
from multilane.engine.errors import UserError


def _ask(prompt: str) -> str | None:
    """A password or passphrase, asked on the terminal only (never stored)."""
    if not sys.stdin.isatty():
        return None
    return getpass.getpass(f"{prompt}: ") or None


def open_connection(args: argparse.Namespace, host: str | None = None) -> Any:
    from multilane.engine.remote.connection import connect

    return connect(
        host or args.host,
        remote_command=getattr(args, "remote_command", None) or "multilane",
        trust=getattr(args, "trust_host_key", None),
        ask=_ask,
    )


def cmd_remote_devices(args: argparse.Namespace) -> int:
    from multilane.engine.cli.monitor import devices_table
    from multilane.engine.remote.devices_answer import read_devices

    with open_connection(args) as conn:
        rows = read_devices(conn)  # checked: a wrong answer is one line naming the host
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        from rich.console import Console

        table = devices_table(rows)
        table.title = printable(conn.name)
        Console().print(table)
    return 0


def cmd_remote_train(args: argparse.Namespace) -> int:
    from multilane.engine.cli.train import _overrides, _run_config
    from multilane.engine.remote.launch import launch_run, resume_run

    overrides = _overrides(args)
    overrides.pop("run.runs_dir", None)  # --runs-dir is where the mirror goes here
    conn = open_connection(args)
    try:
        if args.resume:
            return _resume(conn, args, {k: v for k, v in overrides.items() if k != "task.params"}, resume_run)
        config = _run_config(argparse.Namespace(**{**vars(args), "resume": None}), overrides)
        run = launch_run(conn, config.to_dict(), args.remote_runs_dir)
        where = printable(f"{conn.name}:{run.path}")
        if args.detach:
            print(where)
            return 0
        print(f"training on {where} (pid {run.pid}); Ctrl+C stops it", file=sys.stderr)
        return _follow(conn, run.path, args.runs_dir or config.run.runs_dir, getattr(args, "interval", 0.5), run)
    finally:
        conn.close()


def _resume(conn: Any, args: argparse.Namespace, overrides: dict[str, Any], resume_run: Any) -> int:
    """``train --host H --resume RUN``: followed to its end like a started run (the curves so far, then the
    new steps; the old final status set aside), or with ``--detach`` started and named."""
    from multilane.engine.remote.launch import absolute_there
    from multilane.engine.remote.mirror import mirror_folder
    from multilane.engine.remote.remote_runs import resume_followed

    folder = absolute_there(conn, args.resume)
    if folder is None:
        raise UserError(f"--resume: {printable(conn.name)}:{printable(args.resume)} is not a folder there")
    if args.detach:
        run = resume_run(conn, folder, overrides)
        print(printable(f"{conn.name}:{run.path}"))
        return 0
    local = mirror_folder(args.runs_dir or "runs", conn.spec.label, folder)
    run, follower = resume_followed(conn, folder, local, overrides)
    print(printable(f"resuming {conn.name}:{run.path} (pid {run.pid}); Ctrl+C stops it"), file=sys.stderr)
    return _watch_remote(conn, folder, follower, getattr(args, "interval", 0.5))


def cmd_remote_watch(args: argparse.Namespace, host: str, path: str) -> int:
    args.host = host
    with open_connection(args) as conn:
        if path.startswith("~/"):
            path = path[2:]
        return _follow(conn, path, getattr(args, "runs_dir", None) or "runs", args.interval)


def _follow(conn: Any, remote_dir: str, local_runs: str, interval: float, run: Any = None) -> int:
    from multilane.engine.remote.launch import absolute_there
    from multilane.engine.remote.mirror import RemoteFollower, RemoteMirror, mirror_folder

    where = absolute_there(conn, remote_dir)
    if where is None:
        raise UserError(f"watch: {printable(conn.name)}:{printable(remote_dir)} is not a run folder there")
    remote_dir = where
    try:
        conn.sftp().stat(remote_dir + "/config.json")
    except FileNotFoundError:
        raise UserError(
            f"watch: {printable(conn.name)}:{printable(remote_dir)} is not a run folder (no config.json)"
        ) from None
    local = mirror_folder(local_runs, conn.spec.label, remote_dir)
    return _watch_remote(conn, remote_dir, RemoteFollower(RemoteMirror(conn, remote_dir, local, run)), interval)


def _watch_remote(conn: Any, remote_dir: str, follower: Any, interval: float) -> int:
    from multilane.engine.cli.watch import watch

    print(printable(f"mirror: {follower.run_dir}"), file=sys.stderr)

    def stop() -> str:
        follower.control("stop")
        return printable(f"stop requested on {conn.name} (Ctrl+C again leaves it training)")

    code = watch(follower.run_dir, interval, follower=follower, on_interrupt=stop)
    if follower.done:  # the records the mirror sends for a host that cannot reach the MLflow server
        try:
            follower.close()
        except KeyboardInterrupt:
            print(printable(f"mlflow: left unsent; multilane export {follower.run_dir} --mlflow URI sends the rest"))
    if not follower.done:
        where = printable(f"{conn.name}:{remote_dir}")
        print(f"left {where} training; follow it with: multilane watch {where}")
    return code


def cmd_remote_control(args: argparse.Namespace, host: str, path: str, mirror: Any = None) -> int:
    """``control HOST:RUN_DIR ACTION`` (or a mirror's run there): the control file written in the run
    folder on the host, which its run reads. A run that has ended there, a folder that is not a run, a
    host out of reach: one line, exit 2."""
    from multilane.engine.remote.launch import absolute_there, write_remote_control
    from multilane.engine.remote.remote_runs import FINAL, live_pid, remote_status

    what = f"{host}:{path}"
    prefix = f"control: {printable(str(mirror))} mirrors {printable(what)}: " if mirror else "control: "
    if not path:
        raise UserError(f"{prefix}no run folder named there")
    args.host = host
    try:
        with open_connection(args) as conn:
            folder = absolute_there(conn, path)
            status = remote_status(conn, folder) if folder else None
            if folder is None or status is None:
                raise UserError(f"{prefix}{printable(what)} is not a run folder there (no status.json)")
            if status.get("state") in FINAL:
                raise UserError(
                    f"{prefix}the run there has ended ({printable(str(status['state']))}); nothing to {args.action}"
                )
            if live_pid(conn, folder) is None:
                raise UserError(
                    f"{prefix}no process trains {printable(what)} now (its status says "
                    f"{printable(str(status.get('state')))}); resume it with: multilane train --host "
                    f"{printable(host)} --resume {printable(folder)}"
                )
            write_remote_control(conn, folder, args.action)
    except UserError as e:
        if mirror is not None and not str(e).startswith("control: "):
            raise UserError(f"{prefix}{e}") from None
        raise
    print(printable(f"{args.action} requested on {host}:{folder}"))
    return 0
