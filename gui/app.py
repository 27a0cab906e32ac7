"""``multilane`` with no arguments: the desktop app."""

from __future__ import annotations

import sys
from importlib.resources import files

import pyqtgraph as pg
from PySide6.QtGui import QIcon


def main(argv: list[str] | None = None) -> int:
    app = pg.mkQApp("Multilane")
    app.setApplicationName("Multilane")
    app.setOrganizationName("Multilane")
    icon = files("multilane.assets") / "multilane.svg"
    app.setWindowIcon(QIcon(str(icon)))
    from multilane.gui.window.main_window import MainWindow

    window = MainWindow()
    window.setWindowIcon(QIcon(str(icon)))
    window.show()
    code = app.exec()
    # Everything is saved by now (a run is stopped in closeEvent): leave without Qt's teardown.
    from multilane.gui.plots.export import exit_without_qt_teardown

    exit_without_qt_teardown(code)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv))
