"""Following a run on a host over loopback SSH: the delay from a record written there to its arrival in
the window's follower, and the CPU the follow costs the window's process.

    python bench/remote_follow.py [--seconds 20] [--rate 10]

A real sshd on 127.0.0.1 (tests/sshd_server.py) serves a run folder that a writer thread appends
``--rate`` train records a second to, each stamped with the time it was written. The follower is the
window's own (``RemoteFollower`` polled every ``POLL_S``, as ``RemoteFollowWorker`` does); a record's
delay is its arrival time minus its write time. The window then draws it at its next redraw (at most
``REDRAW_MS`` later, gui/runs/redraw_pace.py), shown added in the last column. CPU: this process's CPU
time (the follower's polls, SFTP, paramiko's transport thread) over the wall time, beside the same
process idle for as long. Goals: delay <= 1 s at the default poll; CPU <= 2 % of one core.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def writer(folder: Path, rate: float, stop: threading.Event) -> None:
    (folder / "config.json").write_text(json.dumps({"task": {"name": "linear"}, "devices": {"use": "cpu:0"}}))
    (folder / "status.json").write_text(json.dumps({"state": "running", "step": 0, "total_steps": 10**9}))
    step = 0
    with open(folder / "metrics.jsonl", "ab", buffering=0) as f:
        while not stop.is_set():
            step += 1
            rec = {"kind": "train", "step": step, "loss": 1.0 / step, "wall_time": time.time(), "written": time.time()}
            f.write((json.dumps(rec) + "\n").encode())
            stop.wait(1.0 / rate)
    (folder / "status.json").write_text(json.dumps({"state": "finished", "step": step, "total_steps": step}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--rate", type=float, default=10.0, help="train records a second")
    args = ap.parse_args()
    from sshd_server import start_sshd

    base = Path(tempfile.mkdtemp(prefix="multilane-bench-remote-"))
    server = start_sshd(base)
    os.environ["HOME"] = str(server.home)
    from multilane.engine.remote.connection import connect
    from multilane.engine.remote.mirror import RemoteFollower, RemoteMirror
    from multilane.gui.runs.follow import POLL_S
    from multilane.gui.runs.redraw_pace import REDRAW_MS

    try:
        remote = server.runs / "run"
        remote.mkdir()
        conn = connect("testhost")
        follower = RemoteFollower(RemoteMirror(conn, str(remote), base / "mirror"))
        # idle: the same process, nothing followed
        c0, t0 = time.process_time(), time.monotonic()
        time.sleep(args.seconds / 2)
        idle_pct = 100 * (time.process_time() - c0) / (time.monotonic() - t0)
        stop = threading.Event()
        w = threading.Thread(target=writer, args=(remote, args.rate, stop))
        delays: list[float] = []
        w.start()
        c0, t0 = time.process_time(), time.monotonic()
        while time.monotonic() - t0 < args.seconds:
            for rec in follower.poll().records:
                delays.append(time.time() - rec["written"])
            time.sleep(POLL_S)
        stop.set()
        w.join()
        wall = time.monotonic() - t0
        follow_pct = 100 * (time.process_time() - c0) / wall
        conn.close()
    finally:
        server.stop()
    delays.sort()
    p50, p95, worst = statistics.median(delays), delays[int(0.95 * (len(delays) - 1))], delays[-1]
    print(f"remote follow over loopback SSH, poll {POLL_S:g} s, {args.rate:g} records/s, {len(delays)} records")
    print(f"{'':28}{'p50':>8}{'p95':>8}{'max':>8}{'max + redraw':>14}")
    row = f"{'delay write -> follower (s)':28}{p50:8.3f}{p95:8.3f}{worst:8.3f}{worst + REDRAW_MS / 1000:14.3f}"
    print(row + ("   goal <= 1 s: met" if worst + REDRAW_MS / 1000 <= 1 else "   goal <= 1 s: NOT met"))
    print(f"{'CPU, % of one core':28}{'idle':>8}{'follow':>8}{'cost':>8}")
    cost = follow_pct - idle_pct
    print(
        f"{'':28}{idle_pct:8.2f}{follow_pct:8.2f}{cost:8.2f}   (includes the writer thread's appends) goal <= 2 %: {'met' if cost <= 2 else 'NOT met'}"
    )


if __name__ == "__main__":
    main()
