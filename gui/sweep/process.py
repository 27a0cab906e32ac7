"""The app's sweep: ``multilane sweep`` as a child process (the window's config as its base), followed
through its study; the app never holds the study's trials in memory only, so a killed app loses
nothing and reopening the sweep folder carries on (``--resume``). Each start writes the form's config to
its own file (two sweeps started together never share one); the sweep keeps it in its ``sweep.json``
(``base``), and the app's copy goes once the sweep folder exists or the child ended. No Qt here."""

from __future__ import annotations

import argparse
import functools
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

    def __init__(self, args: list[str], log_path: Path, storage: str | None = None, base: Path | None = None) -> None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        self.base = base  # this sweep's own base config file, while the child may still read it
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
        stamp = f".app-sweep-{time.time_ns()}-{os.getpid()}"
        base = root / f"{stamp}.config.json"  # this sweep's own: a second start never overwrites it
        with open(base, "x", encoding="utf-8") as f:
            f.write(json.dumps(config, indent=2) + "\n")
        args = ["--config", str(base), "--task", config["task"]["name"], "--sweeps-dir", str(root)]
        args += ["--devices", settings["devices"], "--trials", str(settings["trials"])]
        args += ["--per-trial", str(settings["per_trial"]), "--objective", settings["objective"]]
        args += ["--sampler", settings["sampler"], "--pruner", settings["pruner"], "--name", settings["name"]]
        if settings.get("seed") is not None:
            args += ["--seed", str(settings["seed"])]
        if settings.get("trial_timeout") and sweep_cli_has("--trial-timeout"):
            args += ["--trial-timeout", str(settings["trial_timeout"])]
        for p in params:
            args += ["--param", p]
        return cls(args, root / f"{stamp}.log", settings.get("storage"), base)

    @classmethod
    def resume(cls, folder: str, devices: str) -> SweepProcess:
        return cls(["--resume", folder, "--devices", devices], Path(folder) / "sweep.log")

    def running(self) -> bool:
        return self.proc.poll() is None

    def cleanup(self) -> None:
        """The app's copy of the base config goes (the sweep read it into its sweep.json, or ended)."""
        if self.base is not None:
            self.base.unlink(missing_ok=True)
            self.base = None

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


def recover_lost_trials(sweep: Any) -> list[int]:
    """The app's one call of the CLI's recovery (``--resume`` and every worker do the same,
    ``multilane.engine.sweep.recovery.recover_lost``): trials still "running" in the study whose worker
    process on this machine is gone are recorded lost, their run folders marked, their parameters
    re-queued. The ask and the worker's identity are written under one machine lock that the recovery
    takes too, so a trial being asked on this machine is never judged lost."""
    from multilane.engine.sweep.recovery import recover_lost

    return recover_lost(sweep)


@functools.cache
def sweep_cli_has(option: str) -> bool:
    """Whether this multilane's ``sweep`` command takes ``option`` (the tab offers only what it can pass)."""
    from multilane.engine.cli.parser import build_parser

    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction) and "sweep" in action.choices:
            return option in action.choices["sweep"]._option_string_actions
    return False
