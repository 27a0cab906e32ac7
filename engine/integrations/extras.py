"""Importing an outside library behind an optional extra: the library, or one line naming the extra."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from types import ModuleType

from multilane.engine.errors import UserError


class MissingExtra(ImportError):
    """An integration's library is not installed; the message is one line naming the extra."""


def require(module: str, extra: str, what: str, library: str | None = None) -> ModuleType:
    """``import module``, or ``MissingExtra``: "<what> needs <library>, which is not installed: pip
    install 'multilane[<extra>]'". ``library``: the package that is missing when ``module`` fails
    (``tensorboard`` for ``torch.utils.tensorboard``); by default ``module``'s top-level name."""
    library = library or module.split(".")[0]
    missing = MissingExtra(f"{what} needs {library}, which is not installed: pip install 'multilane[{extra}]'")
    try:
        found = importlib.util.find_spec(library) is not None
    except (ImportError, ValueError):
        found = False
    if not found:  # said before anything heavy (torchvision below) is imported
        raise missing
    if library in ("lightning", "pytorch_lightning", "transformers"):
        _torchvision_importable()
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if e.name is None or e.name.split(".")[0] != library:
            raise  # the library is there but something it needs is broken: its own error says what
        raise missing from None


def _torchvision_importable() -> None:
    """Lightning and transformers import torchvision when it is installed. PyPI's torchvision for the
    CPU build of torch fails its import on ``torchvision::nms``; the imagefolder task already works
    around that exact error (engine/tasks/imagefolder.py), and that is reused here, in one place."""
    from multilane.engine.tasks.imagefolder import torchvision_or_hint

    with contextlib.suppress(UserError):  # not installed: nothing will import it
        torchvision_or_hint()
