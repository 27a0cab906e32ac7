"""A ``torch.distributed.checkpoint`` folder read as data, never as code.

DCP keeps its index in ``.metadata``, a pickle, which ``FileSystemReader`` opens with ``pickle.load``:
a folder from elsewhere could run anything. ``SafeReader`` unpickles it through an allowlist (DCP's
own metadata classes, ``torch.Size``, dtypes, layouts, paths), as ``torch.load(weights_only=True)``
does for ``last.pt``, and checks that every file the index names lies inside the folder.
``SafePlanner`` loads DCP's non-tensor entries (the optimizer's hyperparameters) with
``weights_only=True`` instead of DCP's ``weights_only=False``; tensors already load that way.
A refusal is ``UnsafeCheckpoint``, one line.
"""

from __future__ import annotations

import io
import pickle
import re
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_DCP = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "StorageMeta",
        "MetadataIndex",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}
_FILE = re.compile(r"^[A-Za-z0-9_.-]+$")


class UnsafeCheckpoint(ValueError):
    """A DCP folder that holds something other than data (or points outside itself)."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
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
