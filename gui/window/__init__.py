"""The main window and its panels: files, run control, the runs table and its index, the config form, the device picker, the fit forecast, and the check that Qt can open a window here."""

from multilane.engine.exports import lazy_exports

__getattr__, __all__ = lazy_exports(
    __name__,
    {
        "MainWindow": "main_window",
    },
)
