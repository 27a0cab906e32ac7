"""A checkpoint file on disk: written atomically by ``torch.save`` (a failed write keeps its ``OSError``),
read back by ``torch.load(weights_only=True)`` (no pickle runs) and checked before a resume trusts it."""

from __future__ import annotations

import os
import stat
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch
from multilane.engine.errors import UserError
from multilane.engine.rundir.readfile import describe_os_error, kind_of
from multilane.engine.rundir.runread import checkpoint_problem
from multilane.engine.rundir.writefile import name_it, remove_quietly, temp_name


class _KeepWriteError:
    """A file for ``torch.save`` that keeps the ``OSError`` of a failed write (torch replaces it)."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self._f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        try:
            self._f.flush()
        except OSError as e:
            self.error = e
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


def save_checkpoint_file(target: Path, state: dict[str, Any]) -> None:
    """Write ``state`` to ``target`` atomically with ``torch.save``. On a full disk: ``OSError`` (ENOSPC),
    the temporary file removed, the previous checkpoint untouched."""
    target.parent.mkdir(exist_ok=True)
    tmp = temp_name(target)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as f:
            out = _KeepWriteError(f)
            try:
                torch.save(state, out)
            except RuntimeError:
                # torch reports a failed write as "unexpected pos ..."; the OSError says why.
                if out.error is not None:
                    raise out.error from None
                raise
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException as e:
        remove_quietly(tmp)  # the previous checkpoint stays; the disk gets its space back
        if isinstance(e, OSError):
            name_it(e, target)
        raise


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """A checkpoint's contents, loaded with ``weights_only=True`` (no pickle runs), checked for the
    fields a resume needs; ``UserError`` with one line otherwise."""
    try:
        st = os.stat(path)
    except (OSError, ValueError) as e:
        reason = describe_os_error(e) if isinstance(e, OSError) else str(e)
        raise UserError(f"checkpoint {path}: cannot read it ({reason})") from None
    if not stat.S_ISREG(st.st_mode):
        raise UserError(f"checkpoint {path}: is {kind_of(st.st_mode)}, not a file")
    if st.st_size == 0:
        raise UserError(f"checkpoint {path}: is empty (0 bytes: cut short as it was written?); nothing was changed")
    damage = _zip_damage(path, st.st_size)
    if damage:
        raise UserError(f"checkpoint {path}: {damage}; nothing was changed")
    try:
        with warnings.catch_warnings():  # torch warns (several lines) about odd pickle protocols in junk
            warnings.simplefilter("ignore")
            ck = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise UserError(f"checkpoint {path}: cannot load it ({_torch_load_reason(e)})") from None
    problem = checkpoint_problem(ck)
    if problem:
        raise UserError(f"checkpoint {path}: not a Multilane checkpoint ({problem})")
    return ck


ZIP_MAGIC = b"PK\x03\x04"


def _zip_damage(path: str | Path, size: int) -> str | None:
    """What is wrong with a checkpoint in torch's zip format, read whole once: cut short (its index at
    the end is missing) or changed after it was written (a record fails its CRC-32); None when it is
    whole, or not a zip (torch's older format, or junk: ``torch.load`` says)."""
    try:
        with open(path, "rb") as f:
            if f.read(len(ZIP_MAGIC)) != ZIP_MAGIC:
                return None
        with zipfile.ZipFile(path) as zf:
            bad = zf.testzip()
    except zipfile.BadZipFile as e:
        if "central directory" in str(e) or "not a zip file" in str(e).lower():
            return f"cut short or damaged: {size:,} bytes, its zip index at the end is missing"
        return f"damaged: {str(e)[:120]}"
    except (EOFError, OSError, ValueError, NotImplementedError, RuntimeError) as e:
        return f"cut short or damaged: {size:,} bytes, a record cannot be read ({type(e).__name__})"
    if bad is not None:
        return f"damaged: its record {bad[:80]!r} fails its checksum (changed after it was written)"
    return None


def _torch_load_reason(e: BaseException) -> str:
    """One short reason, without torch's advice to load with ``weights_only=False`` (that would run
    whatever code the file holds)."""
    text = str(e)
    if "WeightsUnpickler error:" in text:
        detail = text.split("WeightsUnpickler error:", 1)[1].strip().splitlines()[0].strip()
        detail = detail.split(" Please use")[0].rstrip(". ")
        return f"it holds something other than tensors and plain data: {detail}"[:200]
    if isinstance(e, EOFError):
        return "the file ends early"
    if isinstance(e, (KeyError, UnicodeDecodeError)) or "invalid load key" in text:
        return "not a torch checkpoint"
    head = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    if "weights_only" in head:
        return "not a checkpoint it can load safely"
    return f"{type(e).__name__}: {head}"[:200] if head else type(e).__name__
