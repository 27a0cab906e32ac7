"""A ``torch.distributed.checkpoint`` folder read as data, never as code.

DCP keeps its index in ``.metadata``, a pickle, which ``FileSystemReader`` opens with ``pickle.load``:
a folder from elsewhere could run anything. ``SafeReader`` unpickles it through an allowlist (DCP's
own metadata classes, ``torch.Size``, dtypes, layouts, paths), as ``torch.load(weights_only=True)``
does for ``last.pt``, and checks that every file the index names lies inside the folder.

The allowlist holds objects, not module paths: the same object is spelled differently by the Python
that wrote the index (3.13 writes ``pathlib._local.PosixPath``; 3.11.0 to 3.11.2 write an Enum member
as ``builtins.getattr(cls, name)``). A name is resolved without importing anything (a module already
loaded here, or pathlib's class under any of its versions' module paths) and accepted when it is one
of those objects; ``getattr`` is accepted only as an index's enum class and one of its members' names.
``SafePlanner`` loads DCP's non-tensor entries (the optimizer's hyperparameters) with
``weights_only=True`` instead of DCP's ``weights_only=False``; tensors already load that way.
A refusal is ``UnsafeCheckpoint``, one line.
"""

from __future__ import annotations

import collections
import enum
import io
import pathlib
import pickle
import re
import sys
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_FILE = re.compile(r"^[A-Za-z0-9_.-]+$")
_DOTTED = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
_NAME = re.compile(r"^[A-Za-z_]\w*$")
_PATHS = ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path")


class UnsafeCheckpoint(ValueError):
    """A DCP folder that holds something other than data (or points outside itself)."""


def _index_objects() -> dict[int, Any]:
    """What an index may name, by identity: DCP's metadata classes (those this torch has), the
    ``torch`` objects they hold (``Size``, dtypes below, layouts through ``_get_layout``), paths, and
    ``OrderedDict``. The value is what the pickle gets: the object itself."""
    from torch.distributed.checkpoint import filesystem, metadata

    names = ["Metadata", "ChunkStorageMetadata", "TensorProperties", "TensorStorageMetadata"]
    names += ["BytesStorageMetadata", "StorageMeta", "MetadataIndex", "_MEM_FORMAT_ENCODING"]
    objects = [getattr(metadata, n) for n in names if hasattr(metadata, n)]
    objects += [getattr(filesystem, "_StorageInfo", None), getattr(torch.serialization, "_get_layout", None)]
    objects += [torch.Size, collections.OrderedDict, *(getattr(pathlib, n) for n in _PATHS)]
    return {id(o): o for o in objects if o is not None}


_ALLOWED = _index_objects()
_ENUMS = tuple(o for o in _ALLOWED.values() if isinstance(o, type) and issubclass(o, enum.Enum))


def _resolve(module: str, name: str) -> Any:
    """The object ``module.name`` means, found without importing anything: a module already loaded
    here (``torch.distributed.checkpoint.metadata``, ``builtins``), or pathlib's class wherever a
    Python version defines it (``pathlib`` up to 3.12, ``pathlib._local`` in 3.13). None if none."""
    if not _DOTTED.match(module) or not _NAME.match(name):
        return None
    if module == "pathlib" or module.startswith("pathlib."):
        return getattr(pathlib, name, None) if name in _PATHS else None
    home = sys.modules.get(module)
    return vars(home).get(name) if home is not None else None


def _enum_member(cls: Any, name: Any) -> Any:
    """``getattr(cls, name)`` as Python 3.11.0 to 3.11.2 pickle an Enum member; only that: ``cls`` one of
    the index's enums and ``name`` one of its members' names."""
    members = cls.__members__ if any(cls is e for e in _ENUMS) else {}
    if not isinstance(name, str) or name not in members:
        shown = f"{getattr(cls, '__qualname__', type(cls).__name__)}.{name}"
        raise UnsafeCheckpoint(
            f"its .metadata asks for getattr of {shown[:80]!r}, which is no member of an index's enum"
        )
    return members[name]


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        obj = _resolve(module, name)
        if obj is getattr:
            return _enum_member
        if obj is not None and (id(obj) in _ALLOWED or isinstance(obj, torch.dtype)):
            return obj
        raise UnsafeCheckpoint(f"its .metadata asks for {module}.{name}, which a checkpoint's index never holds")


def read_metadata_file(data: bytes) -> Metadata:
    """DCP's index from the bytes of a ``.metadata`` file, through the allowlist; checked."""
    try:
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except UnsafeCheckpoint:
        raise
    except Exception as e:
        raise UnsafeCheckpoint(f"its .metadata is not a checkpoint index ({type(e).__name__})") from None
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise UnsafeCheckpoint(f"its .metadata holds a {type(md).__name__}, not a checkpoint index")
    for info in (md.storage_data or {}).values():
        path = getattr(info, "relative_path", None)
        if not isinstance(path, str) or not _FILE.match(path) or path in (".", ".."):
            raise UnsafeCheckpoint(f"its .metadata names a data file {path!r:.60} outside the folder")
    return md


class SafeReader(FileSystemReader):
    """``FileSystemReader`` whose metadata goes through ``read_metadata_file``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        with self.fs.create_stream(self._get_metadata_path(rank), "rb") as f:
            md = read_metadata_file(f.read())
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class SafePlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that loads non-tensor entries with ``weights_only=True``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as e:
            fqn = read_item.dest_index.fqn
            raise UnsafeCheckpoint(
                f"its entry {fqn} holds something other than plain data ({type(e).__name__})"
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
