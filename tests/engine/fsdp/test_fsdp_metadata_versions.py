"""A sharded checkpoint's index reads back under every supported Python, whichever wrote it.

``metadata_pickles/`` holds the bytes of one index as each Python writes it (``write_metadata.py``
says how they were made: with torch where that Python has it, else with stand-ins that pickle as
torch's classes do). Every one reads to the same index; what the allowlist accepts for them
(``getattr`` of an Enum member, pathlib's class under another module path) is accepted for that
meaning only, and the malicious variants are refused in one line without importing anything.
"""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from metadata_pickles.write_metadata import HERE, REFERENCE, real, stand_in
from multilane.engine.fsdp.safe_reader import UnsafeCheckpoint, _MetadataUnpickler, read_metadata_file
from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING, TensorStorageMetadata

VERSIONS = ["3.11.2", "3.11.7", "3.12.1", "3.13.0"]
PYTHONS = {
    "3.11.2": "/usr/bin/python3",
    **{v: str(Path.home() / ".pyenv" / "versions" / v / "bin" / "python") for v in VERSIONS[1:]},
}


@pytest.mark.parametrize("version", VERSIONS)
def test_the_index_each_python_writes_reads_to_the_same_index(version):
    data = (HERE / f"py{version}.metadata").read_bytes()
    md = read_metadata_file(data)
    assert md == read_metadata_file(REFERENCE.read_bytes())
    assert md.storage_meta.checkpoint_id == Path("sharded-2-0123abcd")
    assert type(md.storage_meta.checkpoint_id) is type(Path())  # this Python's own PosixPath
    weights = md.state_dict_metadata["model.0.weight"]
    assert isinstance(weights, TensorStorageMetadata) and weights.size == torch.Size([2, 3])
    assert weights.properties.dtype is torch.float32 and weights.properties.memory_format is torch.contiguous_format
    if version == "3.11.2":  # the spellings the allowlist once refused are really in these bytes
        assert b"getattr" in data and b"TORCH_CONTIGUOUS_FORMAT" in data
    if version == "3.13.0":
        assert b"pathlib._local" in data


def test_the_stand_ins_pickle_as_torch_does_under_this_python():
    data = real()
    assert stand_in(data) == data


@pytest.mark.parametrize("version", ["3.11.2", "3.12.1", "3.13.0"])
def test_the_fixtures_are_what_those_pythons_write(version):
    python = PYTHONS[version]
    if not Path(python).is_file():
        pytest.skip(f"no Python {version} here")
    found = subprocess.run([python, "-c", "import platform; print(platform.python_version())"], capture_output=True)
    if found.stdout.decode().strip() != version:
        pytest.skip(f"{python} is not Python {version}")
    script = "import sys; from write_metadata import *; sys.stdout.buffer.write(stand_in(REFERENCE.read_bytes()))"
    r = subprocess.run([python, "-c", script], cwd=HERE, capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout == (HERE / f"py{version}.metadata").read_bytes()


def call(module: str, name: str, *args: str) -> bytes:
    """A protocol-0 pickle of ``module.name(*args)``; an arg ``"G:mod:name"`` is that global."""
    out = f"c{module}\n{name}\n("
    for a in args:
        out += "c{}\n{}\n".format(*a[2:].split(":")) if a.startswith("G:") else f"V{a}\n"
    return (out + "tR.").encode()


ENUM = "G:torch.distributed.checkpoint.metadata:_MEM_FORMAT_ENCODING"


def test_getattr_of_an_index_enum_member_is_that_member():
    # what the allowlisted unpickler makes of it (before the check that the whole is an index)
    got = _MetadataUnpickler(io.BytesIO(call("builtins", "getattr", ENUM, "TORCH_CHANNELS_LAST"))).load()
    assert got is _MEM_FORMAT_ENCODING.TORCH_CHANNELS_LAST


@pytest.mark.parametrize(
    "data, words",
    [
        # getattr on something that is not one of the index's enums
        (call("builtins", "getattr", "G:torch:Size", "__init__"), "getattr of 'Size.__init__'"),
        (call("builtins", "getattr", "G:pathlib:PosixPath", "unlink"), "getattr of 'PosixPath.unlink'"),
        (call("builtins", "getattr", "G:collections:OrderedDict", "fromkeys"), "getattr of 'OrderedDict.fromkeys'"),
        # getattr of the enum, but of a name that is not a member's
        (call("builtins", "getattr", ENUM, "_member_map_"), "getattr of '_MEM_FORMAT_ENCODING._member_map_'"),
        (call("builtins", "getattr", ENUM, "__class__"), "getattr of '_MEM_FORMAT_ENCODING.__class__'"),
        (call("builtins", "getattr", ENUM, "mro"), "getattr of '_MEM_FORMAT_ENCODING.mro'"),
        # module paths that impersonate pathlib, or name something else under it
        (call("pathlibx", "PosixPath", "/x"), "pathlibx.PosixPath,"),
        (call("evil.pathlib", "PosixPath", "/x"), "evil.pathlib.PosixPath,"),
        (call("pathlib._local", "os", "/x"), "pathlib._local.os,"),
        (call("pathlib", "Path.unlink", "/x"), "pathlib.Path.unlink,"),
        (call("os", "system", "true"), "os.system,"),
        (call("this", "s", "x"), "this.s,"),  # a module not loaded here: refused, never imported
    ],
)
def test_what_only_looks_like_an_index_is_refused_in_one_line(data, words):
    with pytest.raises(UnsafeCheckpoint) as e:
        read_metadata_file(data)
    assert words in str(e.value) and "\n" not in str(e.value)
    assert "this" not in sys.modules


def test_the_index_as_this_python_writes_it_reads_back():
    # whichever Python runs the suite (a newer one may spell the index another way: then add its fixture)
    written = read_metadata_file(stand_in(REFERENCE.read_bytes()))
    assert written == read_metadata_file(REFERENCE.read_bytes())
