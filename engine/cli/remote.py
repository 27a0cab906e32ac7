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

from multilane.engine.cli.terminal_text import printable
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
            run = resume_run(conn, args.resume, {k: v for k, v in overrides.items() if k != "task.params"})
            local_runs = args.runs_dir or "runs"
        else:
            config = _run_config(argparse.Namespace(**{**vars(args), "resume": None}), overrides)
            run = launch_run(conn, config.to_dict(), args.remote_runs_dir)
            local_runs = args.runs_dir or config.run.runs_dir
        where = f"{conn.name}:{run.path}"
        if args.detach:
            print(where)
            return 0
        print(f"training on {where} (pid {run.pid}); Ctrl+C stops it", file=sys.stderr)
        return _follow(conn, run.path, local_runs, args.interval if hasattr(args, "interval") else 0.5, run)
    finally:
        conn.close()


def cmd_remote_watch(args: argparse.Namespace, host: str, path: str) -> int:
    args.host = host
    with open_connection(args) as conn:
        if path.startswith("~/"):
            path = path[2:]
        return _follow(conn, path, getattr(args, "runs_dir", None) or "runs", args.interval)


def _follow(conn: Any, remote_dir: str, local_runs: str, interval: float, run: Any = None) -> int:
    from multilane.engine.cli.watch import watch
    from multilane.engine.remote.mirror import RemoteFollower, RemoteMirror, mirror_folder

    if not remote_dir.startswith("/"):
        code, out, _ = conn.run(f"cd -- {__import__('shlex').quote(remote_dir)} && pwd -P", login=False)
        if code != 0:
            raise UserError(f"watch: {conn.name}:{remote_dir} is not a run folder there")
        remote_dir = out.strip().splitlines()[-1]
    try:
        conn.sftp().stat(remote_dir + "/config.json")
    except FileNotFoundError:
        raise UserError(f"watch: {conn.name}:{remote_dir} is not a run folder (no config.json)") from None
    local = mirror_folder(local_runs, conn.spec.label, remote_dir)
    follower = RemoteFollower(RemoteMirror(conn, remote_dir, local, run))
    print(f"mirror: {local}", file=sys.stderr)

    def stop() -> str:
        follower.control("stop")
        return f"stop requested on {conn.name} (Ctrl+C again leaves it training)"

    code = watch(local, interval, follower=follower, on_interrupt=stop)
    if not follower.done:
        print(f"left {conn.name}:{remote_dir} training; follow it with: multilane watch {conn.name}:{remote_dir}")
    return code
