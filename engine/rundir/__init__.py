"""The run folder on disk: its layout, atomic writes, safe reads, the one-writer lock, the checkpoint file, the control file, and following a run another process writes."""

from multilane.engine.exports import lazy_exports

__getattr__, __all__ = lazy_exports(
    __name__,
    {
        "RunDir": "runlog",
        "read_metrics": "runread",
        "load_metrics": "runread",
        "RunFollower": "follow",
    },
)
