"""The Hugging Face libraries behind the ``[lm]`` extra, imported only when a language model is used, quietly."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from types import ModuleType

EXTRA = "lm"


def transformers() -> ModuleType:
    """``transformers``, or ``MissingExtra`` (one line naming the ``[lm]`` extra)."""
    from multilane.integrations.extras import require

    module = require("transformers", EXTRA, "task causal-lm")
    module.utils.logging.set_verbosity_error()  # no "Loading weights" bars or notices in a run's output
    module.utils.logging.disable_progress_bar()
    return module


def peft() -> ModuleType:
    """``peft``, or ``MissingExtra`` (one line naming the ``[lm]`` extra)."""
    from multilane.integrations.extras import require

    transformers()
    return require("peft", EXTRA, "task causal-lm with lora_rank > 0")


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """The libraries' notices about the model (deprecations, a Conv1D's fan_in_fan_out) kept off a run's output."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", UserWarning)
        yield
