"""A first launch on a bare machine: one line naming what is missing, never Qt's abort."""

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers import CLI
from multilane.gui.window.platform_check import NO_DISPLAY, install_hint, missing_libraries, parse_ldd, window_problem
from PySide6.QtCore import QSettings

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


def test_multilane_with_no_arguments_opens_the_named_window_and_closing_it_ends_the_process(tmp_path):
    # The fast tier's run of gui/app.py: a real process (app_main_child.py), offscreen, its
    # settings in its own config folder.
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "XDG_CONFIG_HOME": str(tmp_path)}
    child = str(Path(__file__).with_name("app_main_child.py"))
    r = subprocess.run([sys.executable, child], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and "Traceback" not in r.stderr, (r.returncode, r.stderr[-3000:])
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    assert seen["windows"] == [{"title": "Multilane", "icon": True}]  # one main window, shown, with its icon
    assert seen["app"] == ["Multilane", "Multilane", True]
    saved = QSettings(str(tmp_path / "Multilane" / "Multilane.conf"), QSettings.IniFormat)
    assert saved.value("geometry") is not None  # closing saved the window where the user's settings live
