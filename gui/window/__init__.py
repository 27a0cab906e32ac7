"""The main window and its panels: files, run control, the config form, the device picker, the fit forecast, the end-of-run summary, and the check that Qt can open a window here (the runs table it shows: ``gui/table/``)."""

from multilane.engine.exports import lazy_exports

__getattr__, __all__ = lazy_exports(
    __name__,
    {
        "MainWindow": "main_window",
    },
)
