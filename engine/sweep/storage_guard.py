"""A sweep's storage checked before anything writes to it, so that no Multilane command leaves a study
``optuna.load_study`` cannot open: a journal whose last record a crash cut short is cut back to its last
whole record (the dropped bytes kept beside it), never appended to; a journal or SQLite file that is
empty, junk, another program's, or written by a newer Optuna is one line naming it, and is left as it
was. Also where a storage URL's password is kept out of sight (``redact``, ``write_private``)."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from multilane.engine.errors import UserError
from multilane.engine.rundir.writefile import write_all

SQLITE_MAGIC = b"SQLite format 3\x00"
OPTUNA_TABLES = {"studies", "trials", "version_info"}


class NotThereYet(UserError):
    """The storage or study a worker names does not exist yet (the sweep may be making it): worth a wait,
    of ``most_s`` seconds at most when given; ``gone``: the line when the wait is over (else "not found")."""

    def __init__(self, what: str, most_s: float | None = None, gone: str | None = None) -> None:
        super().__init__(what)
        self.most_s = most_s
        self.gone = gone

    def given_up(self, waited: float) -> str:
        line = self.gone or f"not found: {self}"
        return line + (f"; waited {waited:.0f} s (--wait S waits longer)" if waited >= 1 else "")


# -- journal files -----------------------------------------------------------------------------------
def check_journal(path: Path) -> None:
    """Refuse a journal that is not a whole Optuna journal; cut a torn last record back (one warning).

    Runs under Optuna's own journal lock, so a record another process is writing right now is not
    taken for a torn one."""
    from optuna.storages.journal import JournalFileSymlinkLock
    from optuna.storages.journal._file import get_lock_file

    if not path.exists():
        if not path.parent.is_dir():
            raise UserError(f"the study's journal {path}: its folder {path.parent} does not exist; check the path")
        raise NotThereYet(f"the study's journal {path}")
    if not path.is_file():
        raise UserError(f"{path}: not a journal file (a folder or a device)")
    with get_lock_file(JournalFileSymlinkLock(str(path))):
        try:
            data = path.read_bytes()
        except OSError as e:
            raise UserError(f"{path}: cannot read it ({e.strerror or e})") from None
        cut = data.rfind(b"\n") + 1
        _check_records(path, data[:cut], torn=len(data) - cut)
        if cut < len(data):
            _cut_back(path, data, cut)


def _check_records(path: Path, whole: bytes, torn: int) -> None:
    from optuna.storages.journal._storage import JournalOperation

    newest = max(JournalOperation)
    if not whole:
        what = "is empty" if not torn else f"holds no whole record ({torn} bytes, no end of line)"
        raise UserError(f"{path} {what}: not an Optuna journal; nothing was changed")
    for i, line in enumerate(whole.splitlines(), start=1):
        try:
            record = json.loads(line)
        except (ValueError, UnicodeDecodeError):
            record = None
        op = record.get("op_code") if isinstance(record, dict) else None
        if not isinstance(op, int) or isinstance(op, bool) or (i == 1 and op != JournalOperation.CREATE_STUDY):
            raise UserError(
                f"{path}: line {i} is not an Optuna journal record: not a study's journal; nothing was changed"
            )
        if op > newest:
            raise UserError(
                f"{path}: line {i} is an operation ({op}) this Optuna does not know: written by a newer "
                "Optuna (pip install -U optuna); nothing was changed"
            )


def _cut_back(path: Path, data: bytes, cut: int) -> None:
    """Keep the torn tail in ``<journal>.torn-<time>`` beside it, then cut the journal to its whole records."""
    dropped = data[cut:]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for i in range(1000):
        keep = path.with_name(f"{path.name}.torn-{stamp}" + (f"-{i}" if i else ""))
        try:
            fd = os.open(keep, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            break
        except FileExistsError:
            continue
    else:
        raise UserError(f"{path}: its last record is torn and no file beside it can take the dropped bytes")
    try:
        write_all(fd, dropped)
        os.fsync(fd)
    finally:
        os.close(fd)
    fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW)
    try:
        os.ftruncate(fd, cut)
        os.fsync(fd)
    finally:
        os.close(fd)
    print(
        f"multilane: warning: {path}: its last record was cut short (a crash while it was written): "
        f"{len(dropped)} bytes dropped, kept in {keep.name}",
        file=sys.stderr,
        flush=True,
    )


# -- SQLite files and databases ----------------------------------------------------------------------
def sqlite_path(url: str) -> Path | None:
    """The file of an ``sqlite:`` URL (None for another database or an in-memory one)."""
    if not url.startswith("sqlite"):
        return None
    from sqlalchemy.engine import make_url

    try:
        db = make_url(url).database
    except Exception:
        return None
    return Path(db) if db and db != ":memory:" else None


def check_sqlite(path: Path, must_exist: bool) -> None:
    """Refuse an SQLite file that is empty, not SQLite, another program's, or of another Optuna's schema."""
    if not path.exists():
        if must_exist:
            where = path.parent if str(path.parent) else Path(".")
            if not where.is_dir():  # no sweep makes a database in a folder that is not there
                what = "is not a folder" if where.exists() else "does not exist"
                raise UserError(f"the study's SQLite database {path}: its folder {where} {what}; check the path")
            shown = f"{path} ({path.absolute()})" if not path.is_absolute() else str(path)
            raise NotThereYet(f"the study's SQLite database {shown}, which does not exist yet")
        return
    if not path.is_file():
        raise UserError(f"{path}: not an SQLite database file (a folder or a device); nothing was changed")
    try:
        with open(path, "rb") as f:
            head = f.read(len(SQLITE_MAGIC))
    except OSError as e:
        raise UserError(f"{path}: cannot read it ({e.strerror or e})") from None
    if not head:
        if must_exist:  # a sweep making it this moment: worth a wait
            raise NotThereYet(f"the study's SQLite database {path} (it is empty: not an Optuna database yet)")
        raise UserError(f"{path} is empty: not an Optuna database; nothing was changed")
    if head != SQLITE_MAGIC:
        raise UserError(f"{path}: not an SQLite database; nothing was changed")
    tables, version = _sqlite_tables(path)
    if not OPTUNA_TABLES.issubset(tables):
        raise UserError(f"{path}: an SQLite database without Optuna's tables (another program's); nothing was changed")
    known, head_rev = _alembic_revisions()
    if version is not None and version != head_rev:
        if version in known:
            raise UserError(f"{path}: written by an older Optuna: run `optuna storage upgrade` on it first")
        raise UserError(f"{path}: written by a newer Optuna (schema {version}): pip install -U optuna")


def _sqlite_tables(path: Path) -> tuple[set[str], str | None]:
    import sqlite3

    try:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            version = None
            if "alembic_version" in tables:
                row = con.execute("SELECT version_num FROM alembic_version").fetchone()
                version = row[0] if row else None
        finally:
            con.close()
    except sqlite3.Error as e:
        raise UserError(f"{path}: not a readable SQLite database ({e}); nothing was changed") from None
    return tables, version


def _alembic_revisions() -> tuple[set[str], str]:
    from alembic.config import Config
    from alembic.script import ScriptDirectory
    from optuna.storages._rdb import models

    cfg = Config()
    cfg.set_main_option("script_location", str(Path(models.__file__).parent / "alembic"))
    script = ScriptDirectory.from_config(cfg)
    return {r.revision for r in script.walk_revisions()}, str(script.get_current_head())


# -- passwords ---------------------------------------------------------------------------------------
_USERINFO = re.compile(r"(://[^/@:?#]*:)([^/@?#]*)@")
_QUERY = re.compile(r"([?&](?:password|passwd|pwd)=)([^&#]*)", re.IGNORECASE)


def has_secret(url: str | None) -> bool:
    return bool(url) and (bool(_USERINFO.search(url)) or bool(_QUERY.search(url)))  # type: ignore[arg-type]


def redact(text: Any) -> str:
    """``text`` with any URL password in it (``user:PW@host``, ``?password=PW``) shown as ``***``."""
    return _QUERY.sub(r"\1***", _USERINFO.sub(r"\1***@", str(text)))


def write_private(path: Path, data: bytes) -> None:
    """Create ``path`` readable by its owner only from its first byte (mode 0600 given to open, no chmod
    window), replacing an old one atomically; a symlink planted in its place is never followed."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)  # a umask only takes bits away; this makes sure of the rest
        write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
