"""Optuna, imported in this one place: the rest of Multilane asks here, and a missing install is one line."""

from __future__ import annotations

import random
import time
from types import ModuleType
from typing import NoReturn

from multilane.engine.errors import UserError

EXTRA = "pip install 'multilane[sweep]'"
RACE_WAIT_S = 60.0


def optuna() -> ModuleType:
    """The ``optuna`` module, quiet (its per-trial INFO lines would break the live table), or one line naming the extra."""
    try:
        import optuna as module
    except ImportError:
        raise UserError(f"sweeps need Optuna, which is not installed: {EXTRA}") from None
    module.logging.set_verbosity(module.logging.WARNING)
    return module


def journal_storage(path: str) -> object:
    """Optuna's JournalStorage on a journal file: what ``optuna.load_study`` and optuna-dashboard open as it is."""
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    optuna()
    return JournalStorage(JournalFileBackend(path))


def rdb_storage(url: str) -> object:
    """An Optuna RDB storage (PostgreSQL, MySQL, SQLite) at ``url``, or one line saying why not. Processes
    that open a fresh database at the same moment race to make Optuna's tables: the losers try again."""
    mod = optuna()
    end = time.monotonic() + RACE_WAIT_S
    while True:
        try:
            return mod.storages.RDBStorage(url, engine_kwargs={"pool_pre_ping": True})
        except Exception as e:  # several processes making Optuna's tables in a fresh database at once
            if not _racing(e) or time.monotonic() > end:
                _refuse(url, e)
            time.sleep(random.uniform(0.2, 1.0))


def _racing(e: Exception) -> bool:
    """Errors of the table-creation race in a fresh database (another process made the same table, type or
    row a moment before), or of a database server that is starting up: each worth another try."""
    text = str(e).lower()
    return any(
        w in text for w in ("already exists", "duplicate key", "unique constraint", "database is locked", "starting up")
    )


def _refuse(url: str, e: Exception) -> NoReturn:
    from multilane.engine.sweep.storage_guard import redact

    if isinstance(e, ImportError):
        raise UserError(
            f"--storage {url.split('://')[0]}: its database driver is not installed ({e.name or e})"
        ) from None
    if isinstance(e, RuntimeError):  # Optuna's schema check: the tables of another Optuna version
        raise UserError(f"--storage {redact(url)}: {redact(str(e).split('. ')[0])}; nothing was changed") from None
    # sqlalchemy's errors: a bad URL, a server that does not answer
    raise UserError(f"--storage: cannot open the database ({redact(str(e).splitlines()[0][:200])})") from None
