"""A runs folder as a collection: which folders are runs, a run's tags and note (``meta.json``),
renaming a run, and deleting one to the trash (with undo).

- ``meta.json`` in the run folder holds what the user says about a run: ``{"tags": [...], "note": "..."}``.
  The trainer never writes it, so a run can be tagged while it trains (written atomically).
- Deleting moves the run folder into ``<runs folder>/.trash/`` (same file system: a rename, instant, no
  copy); undo moves it back. The trash is a hidden folder beside the runs, never listed as a run, and
  emptied by the user (nothing here deletes a file).
- A run that a live process still writes is neither renamed nor deleted (its lock says who).
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any

from multilane.engine.errors import UserError
from multilane.engine.rundir.readfile import describe_os_error, read_regular_file, user_path
from multilane.engine.rundir.run_lock import RunInUse, lock_run_folder
from multilane.engine.rundir.writefile import atomic_write_bytes

METRICS = "metrics.jsonl"  # runread's name; not imported from there, which needs torch (a light import here)
META = "meta.json"
TRASH = ".trash"
_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


def run_folder_problem(path: str | Path) -> str | None:
    """Why ``path`` is not a run folder, in the one wording the app and the CLI share, or None."""
    try:
        p = user_path(path, "run folder")
    except UserError as e:
        return str(e).removeprefix("run folder: ")
    try:
        if not p.exists():
            return f"{p} is not a run folder (it does not exist)"
        if not p.is_dir():
            return f"{p} is not a run folder (it is a file)"
        if not (p / METRICS).exists():
            return f"{p} is not a run folder (no {METRICS})"
    except (OSError, ValueError) as e:
        return f"{p!r} is not a run folder ({e})"
    return None


def says_it_is_a_run(folder: Path) -> bool:
    """Whether ``folder``'s own files say it is a run folder: a ``status.json`` holding an object with a
    ``state``, a ``config.json`` holding an object with a ``task``, a ``metrics.jsonl`` whose first line
    is a record (an object with a ``kind``), or a run just made (its ``.lock`` and ``checkpoints/``).
    An empty folder, a documents folder or a TensorBoard logdir says no: ``control`` writes nothing
    there. Only regular files are read (a FIFO is never opened), and at most 64 KiB of each."""

    def head(name: str) -> bytes:
        try:
            fd = os.open(folder / name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        except (OSError, ValueError):
            return b""
        try:
            return os.read(fd, 1 << 16) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
        except OSError:
            return b""
        finally:
            os.close(fd)

    def an_object_with(text: bytes, key: str) -> bool:
        try:
            data = json.loads(text)
        except (ValueError, RecursionError):
            return False
        return isinstance(data, dict) and key in data

    if an_object_with(head("status.json"), "state") or an_object_with(head("config.json"), "task"):
        return True
    if an_object_with(head(METRICS).split(b"\n", 1)[0], "kind"):
        return True
    try:
        return (folder / "checkpoints").is_dir() and (folder / ".lock").is_file()
    except (OSError, ValueError):
        return False


NOT_A_RUN = "none of its files is a run's: status.json, config.json, metrics.jsonl"


def read_meta(run_dir: str | Path) -> dict[str, Any]:
    """A run's tags (a sorted list of words) and note; empty ones when it has none or they are unreadable."""
    try:
        data = json.loads(read_regular_file(Path(run_dir) / META, 1 << 20))
    except (OSError, ValueError, RecursionError):
        data = {}
    if not isinstance(data, dict):
        data = {}
    tags = data.get("tags")
    note = data.get("note")
    return {
        "tags": sorted({str(t) for t in tags if str(t).strip()}) if isinstance(tags, list) else [],
        "note": note if isinstance(note, str) else "",
    }


def parse_tags(text: str) -> list[str]:
    """Tags as typed: separated by commas or spaces, each kept once."""
    return sorted({t for t in re.split(r"[,\s]+", text) if t})


def write_meta(run_dir: str | Path, tags: list[str] | None = None, note: str | None = None) -> dict[str, Any]:
    """Set a run's tags and/or note (what is not given stays); returns the meta now on disk."""
    p = Path(run_dir)
    meta = read_meta(p)
    if tags is not None:
        meta["tags"] = sorted({t.strip() for t in tags if t.strip()})
    if note is not None:
        meta["note"] = note
    try:
        atomic_write_bytes(p / META, json.dumps(meta, indent=1).encode("utf-8"))
    except OSError as e:
        raise UserError(f"run {p}: cannot write {META} ({describe_os_error(e)})") from None
    return meta


def _not_live(p: Path, doing: str) -> None:
    """Refuse ``doing`` to a run a live process writes (its lock is held)."""
    try:
        lock = lock_run_folder(p)
    except RunInUse as e:
        raise UserError(f"cannot {doing}: {e}") from None
    lock.release()


def rename_run(run_dir: str | Path, new_name: str) -> Path:
    """Rename a run's folder (in the same runs folder); returns the new path."""
    p = Path(run_dir)
    new_name = new_name.strip()
    if not _NAME.match(new_name) or new_name in (".", "..", TRASH):
        raise UserError(f"{new_name!r} is not a run name: use letters, digits, '.', '_' and '-'")
    target = p.parent / new_name
    if target == p:
        return p
    problem = run_folder_problem(p)
    if problem:
        raise UserError(problem)
    if target.exists():
        raise UserError(f"cannot rename {p.name}: {target} already exists")
    _not_live(p, f"rename {p.name}")
    try:
        os.rename(p, target)
    except OSError as e:
        raise UserError(f"cannot rename {p} to {new_name} ({describe_os_error(e)})") from None
    return target


def trash_run(run_dir: str | Path) -> Path:
    """Move a run folder into its runs folder's trash; returns where it went (for ``restore_run``)."""
    p = Path(run_dir)
    problem = run_folder_problem(p)
    if problem:
        raise UserError(problem)
    _not_live(p, f"delete {p.name}")
    trash = p.parent / TRASH
    try:
        trash.mkdir(exist_ok=True)
        target = trash / p.name
        for i in range(2, 1000):
            if not target.exists():
                break
            target = trash / f"{p.name}-{i}"
        os.rename(p, target)
    except OSError as e:
        raise UserError(f"cannot move {p} to the trash ({describe_os_error(e)})") from None
    return target


def restore_run(trashed: str | Path, original: str | Path) -> Path:
    """Undo ``trash_run``: move the folder back where it was."""
    src, dst = Path(trashed), Path(original)
    if dst.exists():
        raise UserError(f"cannot restore {dst.name}: {dst} exists again")
    try:
        os.rename(src, dst)
    except OSError as e:
        raise UserError(f"cannot restore {dst} from the trash ({describe_os_error(e)})") from None
    return dst
