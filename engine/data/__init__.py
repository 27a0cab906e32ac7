"""The input pipeline: from what a task's data() returns to one micro-batch after another, in a seeded, resumable order."""

from multilane.engine.exports import lazy_exports

__getattr__, __all__ = lazy_exports(
    __name__,
    {
        "build_loader": "loader",
        "DataError": "sampling",
    },
)
