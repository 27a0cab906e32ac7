"""A first launch on a bare machine: one line naming what is missing, never Qt's abort."""

import os
import subprocess
import sys

from helpers import CLI
from multilane.gui.window.platform_check import NO_DISPLAY, install_hint, missing_libraries, parse_ldd, window_problem

LDD = """\
\tlinux-vdso.so.1 (0x00007ffd)
\tlibQt6XcbQpa.so.6 => /venv/PySide6/Qt/lib/libQt6XcbQpa.so.6 (0x00007f1)
\tlibxcb-icccm.so.4 => not found
\tlibxcb-keysyms.so.1 => not found
\tlibxcb-icccm.so.4 => not found
\tlibEGL.so.1 => /lib/x86_64-linux-gnu/libEGL.so.1 (0x00007f2)
"""


def test_ldd_output_names_each_missing_library_once():
    assert parse_ldd(LDD) == ["libxcb-icccm.so.4", "libxcb-keysyms.so.1"]


def test_the_install_hint_names_the_packages():
    hint = install_hint(["libxcb-icccm.so.4", "libxcb-keysyms.so.1", "libxcb-cursor.so.0"])
    assert hint.startswith("sudo ")
    assert "libxcb-icccm4" in hint or "xcb-util-wm" in hint
    assert "libxcb-cursor0" in hint or "xcb-util-cursor" in hint


def test_a_library_whose_dependencies_are_all_present_reports_none():
    assert missing_libraries([__import__("pathlib").Path(sys.executable).resolve()]) == []


def test_other_platforms_and_wayland_are_left_to_qt():
    assert window_problem({"QT_QPA_PLATFORM": "offscreen"}) is None
    assert window_problem({"WAYLAND_DISPLAY": "wayland-0"}) is None
    assert window_problem({}) == NO_DISPLAY


def test_the_app_without_a_display_says_so_in_one_line():
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM")}
    r = subprocess.run(CLI, capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2, (r.returncode, r.stderr)  # not 134, Qt's abort
    assert r.stderr.strip() == f"multilane: error: {NO_DISPLAY}"


def test_multilane_with_no_arguments_opens_the_named_window_and_closing_it_ends_the_process(
    qtbot, monkeypatch, tmp_path
):
    """``multilane``: the CLI's app command through ``gui/app.py``'s ``main``, in this process (offscreen).
    Closing the window ends Qt's loop, and ``main`` ends the process without Qt's teardown (``os._exit``),
    which records the code here instead. The window's settings go to the user's settings file,
    redirected to tmp_path for the test."""
    import multilane.gui.plots.export as export
    from multilane.engine.cli.main import main
    from PySide6.QtCore import QSettings, QTimer
    from PySide6.QtWidgets import QApplication

    app = QApplication.instance()
    before = app.applicationName(), app.organizationName(), app.windowIcon()
    home = os.path.dirname(os.path.dirname(QSettings(QSettings.NativeFormat, QSettings.UserScope, "a", "b").fileName()))
    QSettings.setPath(QSettings.NativeFormat, QSettings.UserScope, str(tmp_path))
    exits: list[int] = []
    monkeypatch.setattr(export, "exit_without_qt_teardown", exits.append)
    seen: list = []

    def look_and_close() -> None:
        shown = [w for w in app.topLevelWidgets() if type(w).__name__ == "MainWindow" and w.isVisible()]
        seen.extend((w, w.windowTitle(), w.windowIcon().isNull(), app.windowIcon().isNull()) for w in shown)
        for w in shown:
            w.close()  # as the user does: the last window closed ends Qt's loop with 0
        QTimer.singleShot(10_000, lambda: app.exit(9))  # a window still open somewhere: fail, not hang

    QTimer.singleShot(0, look_and_close)
    try:
        assert main([]) == 0 and exits == [0]
        assert app.applicationName() == "Multilane" and app.organizationName() == "Multilane"
    finally:
        QSettings.setPath(QSettings.NativeFormat, QSettings.UserScope, home)
        app.setApplicationName(before[0])
        app.setOrganizationName(before[1])
        app.setWindowIcon(before[2])
    assert len(seen) == 1, seen  # one main window, shown
    window, title, window_icon_null, app_icon_null = seen[0]
    assert title == "Multilane" and not window_icon_null and not app_icon_null
    assert not window.isVisible()
    saved = QSettings(str(tmp_path / "Multilane" / "Multilane.conf"), QSettings.IniFormat)
    assert saved.value("geometry") is not None  # closing saved the window where the user's settings live
    window.deleteLater()
