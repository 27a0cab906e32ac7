"""``multilane`` with no arguments, in a process of its own (test_gui_platform.py): the CLI's app command
through ``gui/app.py``'s ``main``. Once the window is shown, a timer prints what it sees as one JSON line
and closes the window as the user does; the process then ends as the app ends (``os._exit`` with Qt's
code, skipping Qt's teardown). Not in the test's process: quitting the app runs pyqtgraph's cleanup,
which deletes every plot item of the process."""

import json
import sys

from multilane.engine.cli.main import main
from multilane.gui.window.main_window import MainWindow
from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication


def look_and_close() -> None:
    app = QApplication.instance()
    shown = [w for w in app.topLevelWidgets() if isinstance(w, MainWindow) and w.isVisible()]
    seen = {
        "windows": [{"title": w.windowTitle(), "icon": not w.windowIcon().isNull()} for w in shown],
        "app": [app.applicationName(), app.organizationName(), not app.windowIcon().isNull()],
    }
    print(json.dumps(seen), flush=True)
    for w in shown:
        w.close()  # the last window closed ends Qt's loop


if __name__ == "__main__":
    shown = MainWindow.show

    def show(self: MainWindow) -> None:
        shown(self)
        QTimer.singleShot(0, look_and_close)

    MainWindow.show = show
    sys.exit(main([]))
