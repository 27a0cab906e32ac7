"""Optuna, imported in this one place: the rest of Multilane asks here, and a missing install is one line."""

from __future__ import annotations

from types import ModuleType

from multilane.engine.errors import UserError

EXTRA = "pip install 'multilane[sweep]'"


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
    """An Optuna RDB storage (PostgreSQL, MySQL, SQLite) at ``url``, or one line saying why not."""
    from multilane.engine.sweep.storage_guard import redact

    mod = optuna()
    try:
        return mod.storages.RDBStorage(url, engine_kwargs={"pool_pre_ping": True})
    except ImportError as e:
        raise UserError(
            f"--storage {url.split('://')[0]}: its database driver is not installed ({e.name or e})"
        ) from None
    except RuntimeError as e:  # Optuna's schema check: the tables of another Optuna version
        raise UserError(f"--storage {redact(url)}: {redact(str(e).split('. ')[0])}; nothing was changed") from None
    except Exception as e:  # sqlalchemy's errors: a bad URL, a server that does not answer
        raise UserError(f"--storage: cannot open the database ({redact(str(e).splitlines()[0][:200])})") from None
