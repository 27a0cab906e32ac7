"""Live plots (pyqtgraph) and static figures (matplotlib): the panel, its curves, ranges, marks and style, one palette, decimation, smoothing, figures and export."""

from multilane.engine.exports import lazy_exports

__getattr__, __all__ = lazy_exports(
    __name__,
    {
        "PlotPanel": "panel",
        "export_run": "export",
        "export_headless": "export",
    },
)
