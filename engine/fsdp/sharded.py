"""Sharded checkpoints: the model and optimizer written by ``torch.distributed.checkpoint`` (DCP),
each rank its own shards, and read back by any strategy on any number of devices.

Format (docs/fsdp.md): ``checkpoints/last.pt`` holds everything else (config, step, random streams,
the log window) as for every strategy, with an empty ``model`` and ``optimizer`` and
``"sharded": "sharded-<step>-<tag>"``, the folder beside it that DCP wrote: ``{"model": ...,
"optim": ...}`` in the state-dict helpers' format (parameter names, not positions), so that the
folder fits any sharding of the same model.

Crash-safe: the ranks write into ``.sharded-<step>-<tag>.tmp``; once DCP has written its index (its
last file, after every rank's data), rank 0 renames the folder into place, then replaces
``last.pt`` (fsync, rename), then removes the older folders. A kill at any moment leaves ``last.pt``
naming a whole folder: the previous one until the rename of ``last.pt``, the new one after it.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from multilane.engine.errors import UserError
from multilane.engine.fsdp.safe_reader import SafePlanner, SafeReader, UnsafeCheckpoint
from multilane.engine.tensors.frozen import frozen_names, sharded_options
from torch import nn

NAME = re.compile(r"^sharded-\d+-[0-9a-f]{8}$")
LEFTOVER = re.compile(r"^(sharded-\d+-[0-9a-f]{8}|\.sharded-\d+-[0-9a-f]{8}\.tmp)$")


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def save_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path, step: int, is_main: bool) -> str:
    """Every rank: write this rank's shards under ``folder`` (``checkpoints/``); rank 0 renames the
    finished folder into place. Returns its name, for ``last.pt``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict

    tag: list[Any] = [uuid.uuid4().hex[:8]]
    dist.broadcast_object_list(tag, src=0)
    name = f"sharded-{step}-{tag[0]}"
    tmp = folder / f".{name}.tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    msd, osd = get_state_dict(model, optimizer, options=sharded_options(model))  # frozen weights left out
    dcp.save({"model": msd, "optim": osd}, storage_writer=FileSystemWriter(tmp, sync_files=True))
    if is_main:  # DCP's index is written last, once every rank's data is: the folder is whole
        os.rename(tmp, folder / name)
        _fsync_dir(folder)
    return name


def remove_older(folder: Path, keep: str) -> None:
    """Rank 0, once ``last.pt`` names ``keep``: every other sharded folder (and a crashed save's) goes."""
    with contextlib.suppress(OSError):
        for entry in os.scandir(folder):
            if entry.name != keep and LEFTOVER.match(entry.name) and entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)


def sharded_folder(run_path: Path, name: Any) -> Path:
    if not isinstance(name, str) or not NAME.match(name):
        raise UserError(f"checkpoint in {run_path}: its sharded folder {name!r:.60} is not a checkpoint folder name")
    path = run_path / "checkpoints" / name
    if path.is_symlink() or not path.is_dir() or not (path / ".metadata").is_file():
        raise UserError(f"checkpoint {path}: the sharded checkpoint folder is missing or incomplete")
    return path


def _check_index(path: Path) -> Any:
    """The folder's DCP index, read through the allowlist (before DCP reads it itself)."""
    try:
        return SafeReader(path).read_metadata()
    except UnsafeCheckpoint as e:
        raise UserError(f"checkpoint {path}: refused: {e}") from None
    except OSError as e:
        raise UserError(f"checkpoint {path}: cannot read its index ({e.strerror or e})") from None


def _load_dcp(state: dict[str, Any], path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    _check_index(path)
    try:
        with warnings.catch_warnings():  # "torch.distributed is disabled ... assuming a single process": so it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=SafeReader(path), planner=SafePlanner(), no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as e:
        # DCP wraps each rank's error in a CheckpointException whose text holds the tracebacks: the
        # last "XError: message" line says what went wrong.
        lines = [ln.strip() for ln in str(e).splitlines()]
        unsafe = [ln for ln in lines if ln.startswith(("UnsafeCheckpoint:", "multilane.engine.fsdp"))]
        errors = [ln for ln in lines if re.match(r"^[\w.]+(Error|Exception): ", ln)]
        if isinstance(e, UnsafeCheckpoint) or unsafe:
            detail = str(e) if isinstance(e, UnsafeCheckpoint) else unsafe[-1].split(": ", 1)[1]
            raise UserError(f"checkpoint {path}: refused: {detail}") from None
        head = errors[-1] if errors else next((ln for ln in lines if ln), type(e).__name__)
        raise UserError(f"checkpoint {path}: cannot load it ({head[:200]})") from None


def by_name(native: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """An optimizer state dict in torch's own format (parameters by position) keyed by parameter name,
    as the state-dict helpers take it."""
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    try:
        state = {order[int(k)]: v for k, v in native["state"].items()}
        groups = [{**g, "params": [order[int(i)] for i in g["params"]]} for g in native["param_groups"]]
    except (IndexError, KeyError, TypeError, ValueError):
        raise UserError("checkpoint: its optimizer state does not fit this model") from None
    return {"state": state, "param_groups": groups}


def restore_model(model: nn.Module, optimizer: torch.optim.Optimizer, ck: dict[str, Any], run_path: Path) -> None:
    """The model's and optimizer's state from checkpoint ``ck`` of the run in ``run_path``: its
    sharded folder (any model: plain, DDP's, FSDP's, on any number of ranks), or its full state into
    an FSDP model. Every rank calls it (a collective under torch.distributed)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    if ck.get("sharded") is None:
        optim = by_name(ck["optimizer"], model, optimizer)
        options = StateDictOptions(full_state_dict=True)
        set_state_dict(model, optimizer, model_state_dict=ck["model"], optim_state_dict=optim, options=options)
        return
    path = sharded_folder(run_path, ck["sharded"])
    msd, osd = get_state_dict(model, optimizer)
    # Over a frozen base (checked by the caller), the folder holds the trainable entries only; the
    # frozen ones stay the model's own.
    kept = set(frozen_names(model)) if ck.get("frozen_base") else set()
    state = {"model": {k: v for k, v in msd.items() if k not in kept}, "optim": osd}
    _load_dcp(state, path)
    msd.update(state["model"])
    set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=state["optim"])


def read_model_state(run_path: str | Path) -> dict[str, torch.Tensor]:
    """The model's state (full tensors by name) of a run's checkpoint, sharded or not; in this process,
    without a process group (exports, tests). A model with frozen parameters is saved without them
    (the checkpoint's ``frozen_base`` names them by source and hash: engine/tensors/frozen.py)."""
    from multilane.engine.rundir.checkpoint_file import load_checkpoint
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    run_path = Path(run_path)
    ck = load_checkpoint(run_path / "checkpoints" / "last.pt")
    if ck.get("sharded") is None:
        return ck["model"]
    path = sharded_folder(run_path, ck["sharded"])
    md = _check_index(path)
    model = {
        k[len("model.") :]: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in md.state_dict_metadata.items()
        if k.startswith("model.") and isinstance(m, TensorStorageMetadata)
    }
    _load_dcp({"model": model}, path)
    return model
