import os

# Before any Qt import: the app's tests run on Qt's offscreen platform, with no display.
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest
import torch
from multilane.engine.config import RunConfig, build_config, merge


@pytest.fixture
def make_config(tmp_path):
    """A small, fast config writing into tmp_path; dotted overrides on top."""

    def make(**overrides) -> RunConfig:
        base = {
            "run": {"runs_dir": str(tmp_path / "runs"), "name": "test"},
            "devices": {"use": "cpu:0,cpu:1"},
            "train": {"log_every": 1, "eval_every": 0},
        }
        return build_config(merge(base, {k.replace("__", "."): v for k, v in overrides.items()}))

    return make


@pytest.fixture(autouse=True)
def _torch_threads():
    # Two lanes on a 2-core machine: keep intra-op threads from multiplying against lane threads.
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture
def window(qtbot, tmp_path):
    """The app's main window, offscreen, with its own settings file and runs folder, two CPU lanes."""
    from multilane.gui.main_window import MainWindow
    from PySide6.QtCore import QSettings

    settings = QSettings(str(tmp_path / "settings.ini"), QSettings.IniFormat)
    w = MainWindow(settings)
    qtbot.addWidget(w)
    w.form.editors["run.runs_dir"].widget.setText(str(tmp_path / "runs"))
    w.form.editors["telemetry.record_s"].widget.setText("0.2")
    w.devices.set_checked(["cpu:0", "cpu:1"])
    w.separate.setChecked(False)  # in the app's thread: quicker; tests/test_gui_child.py tests the child
    yield w
    if w.is_running():
        w.run.stop_and_wait()
