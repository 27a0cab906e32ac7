"""How much memory a step holds at its peak: CUDA's own counter on GPUs, live tensor storage on CPU lanes.

- **GPUs**: ``torch.cuda.max_memory_allocated(device)``, reset before the part measured
  (``torch.cuda.reset_peak_memory_stats``): every byte the caching allocator handed to a tensor of
  this process on that device, at its highest. Not ``reserved`` (the allocator's cache, which it
  frees on demand) and not the CUDA context (a few hundred MB, outside torch's count: the picker
  compares against the GPU's *free* memory, which the context of this process does not take again).
- **CPU lanes**: every lane shares the one CPU memory, and torch keeps no count of it. RSS is not
  one either: glibc keeps freed blocks resident, so a step's RSS barely moves after the first one,
  and it includes the interpreter, torch's libraries and the data. The measure is the bytes of
  tensor storage alive, counted exactly: a ``TorchDispatchMode`` sees every aten op, the storage of
  each output is counted once (a view or an in-place result shares one already counted), and a
  ``weakref.finalize`` on the storage takes it off when it is freed. Tensors alive when counting starts
  are found once by the garbage collector (``gc.get_objects``) and counted the same way; the
  parameters' ``.grad`` (held in C++) are added through their parameters. The dispatch mode is
  thread-local, so it is entered in the calling thread and, through the backend's ``parallel_apply``,
  in every lane's thread for the duration. Tensors that existed before the count's ``baseline`` (the
  task's data, held by the loader) are not counted: the forecast is what training adds. A tensor
  subclass that wraps others (fsdp's ``DTensor``) is counted by the tensors inside it.
  A storage can also change size without an op: FSDP frees a gathered parameter by
  ``untyped_storage().resize_(0)`` and gathers it again into the same storage (``resize_(size)``),
  which no dispatch mode sees. At each phase's start the count re-reads the size of every storage it
  holds; one found resized (or found empty) is watched from then on, its size re-read at every op.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import psutil
import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves


class StorageCount:
    """Live bytes of the CPU tensor storages registered with it, and their highest value since ``reset_peak``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[int, int] = {}  # id of a storage object -> its bytes
        self._refs: dict[int, Any] = {}  # id -> a weak reference to the storage, to re-read its size
        self._watch: set[int] = set()  # storages seen resized in place (FSDP's gathered parameters)
        self._foreign: weakref.WeakSet[Any] = weakref.WeakSet()
        self.current = 0
        self.peak = 0

    def baseline(self) -> None:
        """Everything alive now is not training's own (the data): never counted, even if found again."""
        for storage in _live_storages():
            with contextlib.suppress(TypeError):
                self._foreign.add(storage)

    def add_tensor(self, t: Any) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.is_meta:
            return
        if is_traceable_wrapper_subclass(t):  # a DTensor (fsdp's shards): its local tensor holds the bytes
            for name in t.__tensor_flatten__()[0]:
                self.add_tensor(getattr(t, name))
            return
        if t.layout == torch.sparse_coo:  # Embedding(sparse=True)'s gradient: its indices and values hold the bytes
            self.add_tensor(t._indices())
            self.add_tensor(t._values())
            return
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # another storage-less tensor
            return
        key = id(storage)
        if key in self._live or storage in self._foreign:
            return
        nbytes = storage.nbytes()
        with self._lock:
            if key in self._live:
                return
            self._live[key] = nbytes
            self._refs[key] = weakref.ref(storage)
            if nbytes == 0:  # only a resize can give it bytes (FSDP's freed parameters, found by add_live)
                self._watch.add(key)
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        with self._lock:
            self.current -= self._live.pop(key, 0)
            self._refs.pop(key, None)
            self._watch.discard(key)

    def _resized(self, keys: Any, watch: bool) -> None:
        """Take in the size of each storage of ``keys`` that changed in place (``watch``: and watch it)."""
        with self._lock:
            for key in list(keys):
                storage = self._refs.get(key, lambda: None)()
                if storage is None:
                    continue
                nbytes = storage.nbytes()
                if nbytes != self._live[key]:
                    self.current += nbytes - self._live[key]
                    self._live[key] = nbytes
                    if watch:
                        self._watch.add(key)
            self.peak = max(self.peak, self.current)

    def check_watched(self) -> None:
        """Re-read the size of the storages seen resized in place (at every op while counting)."""
        if self._watch:
            self._resized(self._watch, False)

    def add_live(self) -> None:
        """Count every tensor alive now (and every parameter's gradient), except the baseline's."""
        for storage_owner in _live_tensors():
            self.add_tensor(storage_owner)
            if storage_owner.requires_grad and storage_owner.is_leaf:
                self.add_tensor(storage_owner.grad)

    def reset_peak(self) -> None:
        self._resized(list(self._refs), True)
        with self._lock:
            self.peak = self.current


def _live_tensors() -> Iterator[torch.Tensor]:
    # issubclass of the type, not isinstance(): isinstance() reads an object's ``__class__``, which warns on
    # a deprecated module attribute, and silencing that here (catch_warnings) would reset every module's
    # "shown once" record: a user's own warning would then be printed again after every probe step.
    found = [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)]
    yield from found


def _live_storages() -> Iterator[Any]:
    for t in _live_tensors():
        if t.device.type == "cpu" and not t.is_meta:
            with contextlib.suppress(RuntimeError, NotImplementedError):
                yield t.untyped_storage()


class _CountOutputs(TorchDispatchMode):
    """Counts the storage of every output of every aten op run while it is entered (in this thread)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # nothing here is compiled: no torch._dynamo import (seconds) on first use

    def __init__(self, count: StorageCount) -> None:
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count.check_watched()
        out = func(*args, **(kwargs or {}))
        self.count.check_watched()
        for t in tree_leaves(out):
            self.count.add_tensor(t)
        return out


class CpuCounting:
    """While entered: count the calling thread's and every lane's new CPU tensors into ``count``.

    ``backend``'s ``parallel_apply`` is wrapped for the duration (an attribute of that one backend
    object), so each lane's work runs inside a counting mode of its own thread.
    """

    def __init__(self, count: StorageCount, backend: Any | None) -> None:
        self.count, self.backend = count, backend
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> CpuCounting:
        mode = _CountOutputs(self.count)
        self._stack.enter_context(mode)
        if self.backend is not None:
            inner = self.backend.parallel_apply

            def counted(fns: Sequence[Callable[..., Any]], *rest: Any) -> list[Any]:
                return inner([_Counted(f, self.count) for f in fns], *rest)

            self.backend.parallel_apply = counted
            self._stack.callback(delattr, self.backend, "parallel_apply")
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()


class _Counted:
    def __init__(self, fn: Callable[..., Any], count: StorageCount) -> None:
        self.fn, self.count = fn, count

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with _CountOutputs(self.count):
            return self.fn(*args, **kwargs)


def cuda_reset(devices: Sequence[torch.device]) -> None:
    """Start a CUDA peak from the memory allocated now, on each device."""
    for d in devices:
        torch.cuda.synchronize(d)
        torch.cuda.reset_peak_memory_stats(d)


def cuda_peaks(devices: Sequence[torch.device]) -> list[int]:
    """``torch.cuda.max_memory_allocated`` of each device since its last reset."""
    out = []
    for d in devices:
        torch.cuda.synchronize(d)
        out.append(int(torch.cuda.max_memory_allocated(d)))
    return out


def free_bytes(name: str) -> int | None:
    """Free bytes of a memory now: a GPU's (``torch.cuda.mem_get_info``), or the RAM available (psutil)."""
    if name == "cpu":
        return int(psutil.virtual_memory().available)
    try:
        return int(torch.cuda.mem_get_info(torch.device(name))[0])
    except (RuntimeError, AssertionError, ValueError):
        return None
