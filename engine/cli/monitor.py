"""``multilane watch``, ``control`` and ``devices``: follow a run, steer it, and read the devices."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from multilane.engine.display.terminal_text import printable


def cmd_watch(args: argparse.Namespace) -> int:
    from multilane.engine.cli.watch import watch

    return watch(args.run_dir, args.interval)


def cmd_control(args: argparse.Namespace) -> int:
    """Pause, resume or stop a run: here, on a host (``HOST:RUN_DIR``), or the run a local mirror mirrors
    (its ``remote.json`` names the host and folder): never a control file that nothing reads."""
    from pathlib import Path

    from multilane.engine.errors import UserError
    from multilane.engine.remote.hosts import split_remote_path
    from multilane.engine.remote.mirror import read_remote_json
    from multilane.engine.rundir.control_file import write_control
    from multilane.engine.rundir.readfile import user_path

    try:  # a path no system call could take (~nosuchuser, a name over 255 bytes) is one line naming it
        folder: Path = user_path(args.run_dir, "control")
    except UserError:
        if split_remote_path(args.run_dir) is None:
            raise
        folder = Path(args.run_dir)
    try:
        here = folder.exists()
    except (OSError, ValueError):
        here = False
    where = None if here else split_remote_path(args.run_dir)
    if where is None and here and folder.is_dir():
        info = read_remote_json(folder)
        if info is not None:
            where = (info["host"], str(info.get("path") or ""))
            args.remote_command = args.remote_command or info.get("remote_command")
    if where is not None:
        from multilane.engine.cli.remote import cmd_remote_control

        return cmd_remote_control(args, *where, mirror=folder if here else None)
    path = write_control(args.run_dir, args.action)
    print(printable(f"{args.action} requested: {path}"))
    return 0


def cmd_devices(args: argparse.Namespace) -> int:
    """The devices table (or JSON). A GPU that cannot be read or a driver that does not answer (each call
    bounded: ``telemetry/driver.py``) leaves its rows out and is one line on stderr, exit 1; the rest is
    shown."""
    from multilane.engine.telemetry.sampler import live_readings

    problems: list[str] = []
    if args.json:
        print(json.dumps(live_readings(problems=problems), indent=2))
    elif not args.watch:
        from rich.console import Console

        Console().print(devices_table(live_readings(problems=problems)))
    else:
        from rich.live import Live

        with Live(devices_table(live_readings(problems=problems)), auto_refresh=False) as live:
            try:
                while True:
                    live.update(devices_table(live_readings(1.0, problems)), refresh=True)
            except KeyboardInterrupt:
                pass
    for line in dict.fromkeys(problems):
        print(f"multilane: warning: {printable(line)}", file=sys.stderr)
    return 1 if problems else 0


def devices_table(rows: list[dict]) -> Any:
    from rich.markup import escape
    from rich.table import Table

    table = Table(box=None, header_style="bold")
    for col in ("device", "model", "util", "memory used / total", "temp", "power"):
        table.add_column(col)
    for r in rows:
        util = f"{r['util_pct']:.0f}%" if r.get("util_pct") is not None else "-"
        used, total = r.get("mem_used_mb"), r.get("memory_total_mb")
        memory = f"{used / 1024:,.1f} / {total / 1024:,.1f} GiB" if used is not None and total else "-"
        temp = f"{r['temp_c']:.0f} °C" if "temp_c" in r else "-"
        power = f"{r['power_w']:.0f} W" if "power_w" in r else "-"
        if r["kind"] == "cuda":
            name, model = r["name"], str(r.get("model", ""))
        else:  # the lanes the app's device list offers (one rule: telemetry/devices.py cpu_lane_count)
            lanes = r.get("lanes") or 2
            name, model = f"cpu:0–cpu:{lanes - 1}", f"{lanes} CPU lanes on {r['cores']} cores · {r.get('model', '')}"
        # what the driver or /proc says (a GPU's name, the CPU's model) is text, not rich markup
        table.add_row(*(escape(printable(c)) for c in (name, model, util, memory, temp, power)))
    return table
