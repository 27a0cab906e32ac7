"""The app's Sweep tab: the search space beside the form, the sweep as a child process, its live trials table, parallel coordinates and importances, and their export."""

from multilane.engine.exports import lazy_exports

__getattr__, __all__ = lazy_exports(
    __name__,
    {"SweepTab": "tab", "sweep_figure": "figures", "export_sweep": "figures", "SweepProcess": "process"},
)
