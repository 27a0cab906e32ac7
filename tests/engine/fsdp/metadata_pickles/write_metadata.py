"""Write a sharded checkpoint's ``.metadata`` as the Python running this script writes it.

The same index is pickled differently by different Pythons: 3.11.0 to 3.11.2 write an Enum member as
``builtins.getattr(cls, name)``, 3.13 writes a path as ``pathlib._local.PosixPath``. The fixtures beside
this script are those bytes, one file per Python, read by ``test_fsdp_metadata_versions.py``.

    python write_metadata.py --real      # with torch: DCP saves a small model and its optimizer; this
                                         # Python's .metadata is written as py<X.Y.Z>.metadata
    python write_metadata.py             # without torch: the real index of ``REFERENCE`` unpickled
                                         # into stand-ins and pickled again by this Python

The stand-ins carry the module path and name of what they stand for, and pickle as it does (a
dataclass's state, a call's arguments, a global's name); what a Python version decides itself (an
Enum member, a path) is that version's real Enum and real pathlib. Under a Python that has torch both
ways give the same bytes (``test_the_stand_ins_pickle_as_torch_does_under_this_python``; it passes
under 3.11.7 and, with torch installed there, under Debian's 3.11.2).

Regenerate: ``python write_metadata.py --real`` with the suite's Python (3.11.7: the reference), then
``python write_metadata.py`` with each other Python (/usr/bin/python3 3.11.2, pyenv's 3.12.1 and
3.13.0), so that every file holds the same index (the same save id) in its Python's spelling.
"""

from __future__ import annotations

import copyreg
import enum
import io
import os
import pickle
import platform
import sys
import tempfile
import types
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
REFERENCE = HERE / "py3.11.7.metadata"

MEM_FORMATS = {"TORCH_CONTIGUOUS_FORMAT": 0, "TORCH_CHANNELS_LAST": 1, "TORCH_PRESERVE_FORMAT": 2}
"""``torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING``'s members."""


def real() -> bytes:
    """DCP's index of a small model and its Adam state (two steps), saved as the fsdp trainer saves."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(2):
        model(torch.randn(4, 3)).square().mean().backward()
        opt.step()
    msd, osd = get_state_dict(model, opt)
    was = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)  # a relative folder: the index names it, and it is the same on every machine
        try:
            folder = Path("sharded-2-0123abcd")
            with warnings.catch_warnings():  # "assuming ... a single process": so it is
                warnings.simplefilter("ignore", UserWarning)
                dcp.save({"model": msd, "optim": osd}, storage_writer=FileSystemWriter(folder), no_dist=True)
            return (folder / ".metadata").read_bytes()
        finally:
            os.chdir(was)


class _Data:
    """A DCP dataclass: made without ``__init__``, its state as pickled (``copyreg.__newobj__``)."""

    def __setstate__(self, state: object) -> None:
        self._state = state

    def __reduce_ex__(self, protocol: int) -> tuple:
        if hasattr(self, "_state"):
            return copyreg.__newobj__, (type(self),), self._state
        return copyreg.__newobj__, (type(self),)


class _Call:
    """What a call in the pickle made (``torch.Size(...)``, ``_get_layout(...)``): pickles as that call."""

    def __init__(self, func: object, args: tuple) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple:
        return self.func, self.args


class _Global:
    """A module global that is no class (``torch.float32``): pickles by its name."""

    def __init__(self, module: str, name: str) -> None:
        self.__module__, self.name = module, name

    def __reduce__(self) -> str:
        return self.name


def _module(name: str) -> types.ModuleType:
    if name not in sys.modules:
        sys.modules[name] = types.ModuleType(name)
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(_module(parent), child, sys.modules[name])
    return sys.modules[name]


def _callable(module: str, name: str) -> object:
    def call(*args: object) -> _Call:
        return _Call(call, args)

    call.__module__, call.__qualname__, call.__name__ = module, name, name
    return call


class _StandIns(pickle.Unpickler):
    """Every torch name the index asks for becomes a stand-in in a module of that path; pathlib,
    collections and builtins are this Python's own."""

    def find_class(self, module: str, name: str) -> object:
        if not module.startswith("torch"):
            return super().find_class(module, name)
        home = _module(module)
        if name not in vars(home):
            if name == "_MEM_FORMAT_ENCODING":
                made: object = enum.Enum(name, MEM_FORMATS, module=module, qualname=name)
            elif name == "Size":
                made = type(name, (tuple,), {"__module__": module, "__reduce__": lambda s: (type(s), (tuple(s),))})
            elif name[0].isupper() or (name.startswith("_") and name[1].isupper()):
                made = type(name, (_Data,), {"__module__": module, "__qualname__": name})
            elif name.startswith("_"):
                made = _callable(module, name)
            else:
                made = _Global(module, name)
            setattr(home, name, made)
        return getattr(home, name)


def stand_in(reference: bytes) -> bytes:
    """``reference`` (a real index) unpickled into stand-ins and pickled again by this Python."""
    return pickle.dumps(_StandIns(io.BytesIO(reference)).load())


def main(argv: list[str]) -> None:
    data = real() if "--real" in argv else stand_in(REFERENCE.read_bytes())
    out = HERE / f"py{platform.python_version()}.metadata"
    out.write_bytes(data)
    print(f"wrote {out} ({len(data)} bytes, {'torch' if '--real' in argv else 'stand-ins'})")


if __name__ == "__main__":
    main(sys.argv[1:])
