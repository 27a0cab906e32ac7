"""A package's public names, imported on first use, so that importing a light module of a package never
imports torch through the package's ``__init__`` (the CLI checks a config before torch is imported)."""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import Any


def lazy_exports(package: str, names: dict[str, str]) -> tuple[Callable[[str], Any], list[str]]:
    """``__getattr__`` and ``__all__`` for a package offering ``names`` (public name -> its module)."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(import_module(f"{package}.{names[name]}"), name)

    return __getattr__, sorted(names)
