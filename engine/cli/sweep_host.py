"""``multilane sweep-worker --host HOST``: the worker started on a host over SSH (engine/remote/sweep_worker.py),
detached there in its own session. Without ``--detach`` this command shows the worker's console log
until it ends, and Ctrl+C stops it there (its running trials are re-queued); with ``--detach`` it prints
the worker's pid and log and returns. ``--stop PID`` stops a detached one."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from typing import Any

from multilane.engine.cli.interrupts import answer_missed_ctrl_c
from multilane.engine.errors import UserError

POLL_S = 1.0


def cmd_sweep_worker_host(args: argparse.Namespace) -> int:
    from multilane.engine.cli.remote import open_connection
    from multilane.engine.cli.sweep import _storage
    from multilane.engine.remote.sweep_worker import check_shareable, start_worker, stop_worker

    if not args.host:
        raise UserError("sweep-worker --stop PID stops a worker on a host: name it with --host HOST")
    if args.stop:
        with open_connection(args) as conn:
            gone = stop_worker(conn, args.stop)
        print(f"sweep-worker {args.stop} on {args.host}: {'stopped' if gone else 'still running'}")
        return 0 if gone else 1
    url = check_shareable(_storage(args))  # before connecting: a journal or SQLite file cannot be shared
    if not args.study:
        raise UserError("sweep-worker: give --study NAME (the sweep's --name)")
    conn = open_connection(args)
    try:
        w = start_worker(
            conn, url, args.study, args.devices or "auto", args.per_trial, args.sweeps_dir, args.worker_name
        )
        print(f"sweep-worker on {w.host}: pid {w.pid} · console log {w.host}:{w.log}", flush=True)
        print(f"  stop it with: multilane sweep-worker --host {w.host} --stop {w.pid}", flush=True)
        if args.detach:
            return 0
        return _follow(conn, w)
    finally:
        conn.close()


def _follow(conn: Any, w: Any) -> int:
    """The worker's console log as it grows, until it ends; Ctrl+C stops it there (once; again: leave it)."""
    from multilane.engine.remote.sweep_worker import read_log, stop_worker, worker_running

    asked = 0

    def on_signal(signum: int, frame: Any) -> None:
        nonlocal asked
        asked += 1
        if asked > 1:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    answer_missed_ctrl_c(on_signal)
    offset = 0
    stopping = False
    try:
        while True:
            running = worker_running(conn, w.pid)
            text, offset = read_log(conn, w.log, offset)
            if text:
                sys.stdout.write(text)
                sys.stdout.flush()
            if not running:
                return 0 if not stopping else 130
            if asked and not stopping:
                stopping = True
                print(f"stopping the worker on {w.host}: its running trials stop and are re-queued", flush=True)
                gone = stop_worker(conn, w.pid)
                print(f"sweep-worker {w.pid} on {w.host}: {'stopped' if gone else 'still running'}", flush=True)
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        print(f"left the worker running on {w.host}; stop it with: multilane sweep-worker --host {w.host} "
              f"--stop {w.pid}", file=sys.stderr)  # fmt: skip
        return 130
