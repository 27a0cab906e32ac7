"""Where a window's run comes from: the worker thread, the child process, the follower of a run folder (a local one, or one on a host over SSH, mirrored), the run's data as numpy columns, and the redraw pace."""

from multilane.engine.exports import lazy_exports

__getattr__, __all__ = lazy_exports(
    __name__,
    {
        "RunData": "run_data",
        "TrainWorker": "worker",
        "FollowWorker": "follow",
        "ChildRun": "child_run",
    },
)
