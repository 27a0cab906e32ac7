"""Importing an outside library behind an optional extra: the library, or one line naming the extra."""

from __future__ import annotations

import contextlib
import importlib
from types import ModuleType

from multilane.engine.errors import UserError


class MissingExtra(ImportError):
    """An integration's library is not installed; the message is one line naming the extra."""


def require(module: str, extra: str, what: str) -> ModuleType:
    """``import module``, or ``MissingExtra``: "<what> needs <module>: pip install 'multilane[<extra>]'"."""
    if module.split(".")[0] in ("lightning", "pytorch_lightning", "transformers"):
        _torchvision_importable()
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if e.name is None or module.split(".")[0] != e.name.split(".")[0]:
            raise  # the library is there but something it needs is broken: its own error says what
        raise MissingExtra(
            f"{what} needs {module.split('.')[0]}, which is not installed: pip install 'multilane[{extra}]'"
        ) from None


def _torchvision_importable() -> None:
    """Lightning and transformers import torchvision when it is installed. PyPI's torchvision for the
    CPU build of torch fails its import on ``torchvision::nms``; the imagefolder task already works
    around that exact error (engine/tasks/imagefolder.py), and that is reused here, in one place."""
    from multilane.engine.tasks.imagefolder import torchvision_or_hint

    with contextlib.suppress(UserError):  # not installed: nothing will import it
        torchvision_or_hint()
