"""Ctrl+C while a command starts: held while an extension loads, then raised as if pressed just then.

A ``KeyboardInterrupt`` raised while an extension module initialises goes wrong in every way: of 32
presses during ``multilane train``'s start, 4 were swallowed (the run trained to its end), 1 aborted the
process (SIGABRT: "terminate called after throwing an instance of 'pybind11::error_already_set'"), 1 was
a numpy ImportError traceback and 1 a false "setup failed: RecursionError"
(tests/engine/cli/test_ctrl_c_during_start.py). Two holds (``ctrl_c_held``):

- ``hold_ctrl_c_while_torch_loads``, a command's first act: wherever torch is first imported (a command,
  a task file, a ddp rank), SIGINT only sets a flag until the whole import is done (its Python calls into
  C++ and back);
- ``hold_ctrl_c_while_extensions_load``, from the ``multilane.engine.cli`` package's import on: every C
  extension's initialisation (pydantic's and psutil's as the command's modules load, a library imported
  later, on a command's first poll or first step) holds SIGINT the same way.

Either way the press is raised again at the hold's end, for the handler in place by then (the default
one: "multilane: interrupted", 130). And for what no hold covers:

- ``note_ctrl_c``: Python's own handler, which raises ``KeyboardInterrupt``, but noting the press first. A
  ``KeyboardInterrupt`` raised in a finalizer or a callback is printed as "Exception ignored" and lost,
  and a library may catch it; the command's long waits (``watch``'s loop, ``train``'s and ``sweep``'s
  own handlers once in place) ask ``missed_ctrl_c`` and answer a press that was lost that way.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any


@contextlib.contextmanager
def ctrl_c_held() -> Iterator[None]:
    """SIGINT inside the block only sets a flag; at its end it is raised again, for the handler in place
    then. In the main thread only (signals reach no other); nested holds pass a press outwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pressed: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, _frame: pressed.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if pressed:
            signal.raise_signal(signal.SIGINT)  # to the handler in place now, as if pressed just now


_noted: list[int] = []  # presses raised as KeyboardInterrupt that no command has answered yet


def _raise_noted(signum: int, _frame: Any) -> None:
    _noted.append(signum)
    raise KeyboardInterrupt


def note_ctrl_c() -> None:
    """Ctrl+C raises ``KeyboardInterrupt`` as Python's own handler does, and is noted (``missed_ctrl_c``).
    Only in place of Python's own handler, in the main thread."""
    main = threading.current_thread() is threading.main_thread()
    if main and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _raise_noted)


def missed_ctrl_c() -> bool:
    """Whether a Ctrl+C was pressed since the last ask (its ``KeyboardInterrupt`` lost on the way, or
    answered by whoever asks now): the note is then forgotten."""
    pressed = bool(_noted)
    _noted.clear()
    return pressed


def answer_missed_ctrl_c(on_signal: Any) -> None:
    """Call a command's own SIGINT handler, just put in place, for a press that was lost before it."""
    if missed_ctrl_c():
        on_signal(signal.SIGINT, None)


def hold_ctrl_c_while_extensions_load() -> None:
    """Hold SIGINT (``ctrl_c_held``) while any C extension module initialises, from now on in this process."""
    from importlib.machinery import ExtensionFileLoader

    if getattr(ExtensionFileLoader, "_ctrl_c_held", False):
        return
    create, execute = ExtensionFileLoader.create_module, ExtensionFileLoader.exec_module

    def create_module(self: Any, spec: ModuleSpec) -> Any:
        with ctrl_c_held():
            return create(self, spec)

    def exec_module(self: Any, module: ModuleType) -> None:
        with ctrl_c_held():
            execute(self, module)

    ExtensionFileLoader.create_module = create_module  # type: ignore[method-assign]
    ExtensionFileLoader.exec_module = exec_module  # type: ignore[method-assign]
    ExtensionFileLoader._ctrl_c_held = True  # type: ignore[attr-defined]


class _HoldWhileTorchLoads:  # a meta path finder (importlib.abc's base class costs an import)
    """Finds nothing itself: asks the finders after it for ``torch``, and holds SIGINT around its load."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname != "torch":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)  # once: torch loads once per process
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            spec: ModuleSpec | None = find(fullname, path, target) if find else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    _hold_during(spec.loader)
                return spec
        return None


def _hold_during(loader: Any) -> None:
    run = loader.exec_module

    def exec_module(module: ModuleType) -> None:
        del loader.exec_module  # the loader as it was, for any later use
        with ctrl_c_held():
            run(module)

    loader.exec_module = exec_module


def hold_ctrl_c_while_torch_loads() -> None:
    """Install the hold for this process's first ``import torch`` (nothing if torch is loaded already)."""
    if "torch" not in sys.modules and not any(isinstance(f, _HoldWhileTorchLoads) for f in sys.meta_path):
        sys.meta_path.insert(0, _HoldWhileTorchLoads())
