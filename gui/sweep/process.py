"""The app's sweep: ``multilane sweep`` as a child process (the window's config as its base), followed
through its study; the app never holds the study's trials in memory only, so a killed app loses
nothing and reopening the sweep folder carries on (``--resume``). No Qt here."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from multilane.engine.errors import UserError

SWEEP = [sys.executable, "-m", "multilane.engine.cli", "sweep", "--no-table"]


class SweepProcess:
    """One ``multilane sweep`` process and the folder it writes into."""

    def __init__(self, args: list[str], log_path: Path, storage: str | None = None) -> None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        if storage:  # its password on no command line: `--storage -` reads it from standard input
            args = [*args, "--storage", "-"]
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [*SWEEP, *args],
                stdin=subprocess.PIPE if storage else subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        if storage and self.proc.stdin is not None:
            with self.proc.stdin:
                self.proc.stdin.write((storage + "\n").encode())

    @classmethod
    def start(
        cls, config: dict[str, Any], params: list[str], settings: dict[str, Any], sweeps_dir: str
    ) -> SweepProcess:
        """A new sweep of ``config`` (the form's), searching ``params`` (``--param`` specs)."""
        root = Path(sweeps_dir).expanduser()
        root.mkdir(parents=True, exist_ok=True)
        base = root / ".app-sweep-config.json"
        base.write_text(json.dumps(config, indent=2) + "\n")
        args = ["--config", str(base), "--task", config["task"]["name"], "--sweeps-dir", str(root)]
        args += ["--devices", settings["devices"], "--trials", str(settings["trials"])]
        args += ["--per-trial", str(settings["per_trial"]), "--objective", settings["objective"]]
        args += ["--sampler", settings["sampler"], "--pruner", settings["pruner"], "--name", settings["name"]]
        if settings.get("seed") is not None:
            args += ["--seed", str(settings["seed"])]
        for p in params:
            args += ["--param", p]
        return cls(args, root / f".app-sweep-{time.time_ns()}.log", settings.get("storage"))

    @classmethod
    def resume(cls, folder: str, devices: str) -> SweepProcess:
        return cls(["--resume", folder, "--devices", devices], Path(folder) / "sweep.log")

    def running(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        """Stop the sweep: its running trials stop with a checkpoint and are re-queued for a resume."""
        if self.running():
            os.kill(self.proc.pid, signal.SIGINT)

    def error_line(self) -> str | None:
        """The sweep's ``multilane: error:`` line, once it has ended with one."""
        if self.running() or self.proc.returncode in (0, 130):
            return None
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "the sweep ended with an error"
        for line in reversed(lines):
            if line.startswith("multilane: error:"):
                return line.removeprefix("multilane: error:").strip()
        return lines[-1] if lines else "the sweep ended with an error"

    def folder(self) -> Path | None:
        """The sweep folder, from the first line the sweep prints ("sweep FOLDER · ...")."""
        try:
            for line in self.log_path.read_text(errors="replace").splitlines():
                if line.startswith("sweep ") and " · " in line:
                    return Path(line.removeprefix("sweep ").split(" · ")[0])
        except OSError:
            return None
        return None


def check_params(params: list[str], task: str) -> str | None:
    """The first bad ``--param`` spec's one line, or None (the tab says it before starting anything)."""
    from multilane.engine.sweep.space import parse_params

    try:
        parse_params(params, task)
    except UserError as e:
        return str(e)
    return None
