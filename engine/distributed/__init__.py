"""Scale-out on torch.distributed: one process per device, DistributedDataParallel, torch's elastic launcher.

``rank.py`` (who this process is, the process group), ``window.py`` (a rank's log window),
``ddp.py`` (the ddp strategy), ``worker.py`` (a rank's entry point), ``launcher.py`` (starting the
ranks through torch.distributed's elastic agent and reporting how they ended).

This module itself imports nothing heavy: the CLI asks ``in_worker()`` before it imports torch.
"""

import os

from multilane.engine.start import NODE_FILE_ENV  # the rank server records deaths beside that file

_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
COMMAND_START_ENV = "MULTILANE_COMMAND_START"  # when `multilane train` started: its ranks' "X s in all"
RUN_DIR_ENV = "MULTILANE_RUN_DIR"  # the run folder the launcher created for this run


def in_worker() -> bool:
    """True inside a process started by torchrun or the elastic agent."""
    return all(k in os.environ for k in _ENV)


def command_start() -> float | None:
    """The launching command's start (``COMMAND_START_ENV``), where a launcher set it."""
    try:
        return float(os.environ[COMMAND_START_ENV])
    except (KeyError, ValueError):
        return None


__all__ = ["COMMAND_START_ENV", "NODE_FILE_ENV", "RUN_DIR_ENV", "command_start", "in_worker"]
