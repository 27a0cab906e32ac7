"""Small pieces the sweep tests share: a tiny digits sweep's flags and plain Optuna reads of its study."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from helpers import CLI

# Tiny trials: 10 steps, an evaluation every 5, so a pruner has something to compare.
TINY = ["--task", "digits", "--steps", "10", "--set", "train.eval_every=5", "--set", "train.log_every=5"]


def sweep_cli(*args: str, timeout: float = 900, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, **kwargs)


def sweep_folder(sweeps_dir: Path) -> Path:
    (folder,) = [p for p in sweeps_dir.iterdir() if (p / "sweep.json").is_file()]
    return folder


def load_journal(folder: Path):
    """The study as any Optuna user opens it: plain optuna.load_study on the folder's journal file."""
    import optuna
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    storage = JournalStorage(JournalFileBackend(str(folder / "study.journal")))
    return optuna.load_study(study_name=None, storage=storage)


def study_names(url: str) -> list[str]:
    """The studies in a database a sweep may be making its tables in at this moment: opened through the
    product's storage, which waits out that race, where plain ``optuna.get_all_study_names(url)`` would
    make the same tables and lose it (a duplicate-key error)."""
    import optuna
    from multilane.engine.sweep.optuna_lib import rdb_storage

    return optuna.get_all_study_names(rdb_storage(url))


def last_step(run_dir: Path) -> int:
    steps = [json.loads(line).get("step", 0) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return max(steps)
