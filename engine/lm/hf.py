"""The Hugging Face libraries behind the ``[lm]`` extra, imported only when a language model is used, quietly."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from types import ModuleType

EXTRA = "lm"


def _require(module: str, what: str) -> ModuleType:
    from multilane.engine.errors import UserError
    from multilane.integrations.extras import MissingExtra, require

    try:
        return require(module, EXTRA, what)
    except MissingExtra as e:  # a refusal like any bad input: one line, exit 2
        raise UserError(str(e)) from None


def transformers() -> ModuleType:
    """``transformers``, or ``UserError``: one line naming the ``[lm]`` extra."""
    module = _require("transformers", "task causal-lm")
    module.utils.logging.set_verbosity_error()  # no "Loading weights" bars or notices in a run's output
    module.utils.logging.disable_progress_bar()
    import huggingface_hub

    huggingface_hub.utils.logging.set_verbosity_error()  # an unreachable Hub: one line at the end, not each retry
    return module


def peft() -> ModuleType:
    """``peft``, or ``UserError``: one line naming the ``[lm]`` extra."""
    transformers()
    return _require("peft", "task causal-lm with lora_rank > 0")


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """The libraries' notices about the model (deprecations, a Conv1D's fan_in_fan_out) kept off a run's output."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", UserWarning)
        yield
