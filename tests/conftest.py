# Tests: where a new test goes is in tests/README.md (one folder per room of the code).
import os

# Before any Qt import: the app's tests run on Qt's offscreen platform, with no display.
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
# The fit check (engine/plan/) probes every run before it starts (a second or more): off for the suite,
# on in the tests of the check itself (tests/engine/plan/), which set it back to 1.
os.environ.setdefault("MULTILANE_FIT_CHECK", "0")

import compileall
from pathlib import Path

import pytest
import torch
import warm_cli
from multilane.engine.config import RunConfig, build_config, merge

# A real OpenSSH server on 127.0.0.1 (the `sshd` and `ssh_home` fixtures), for the tests of remote hosts.
pytest_plugins = ["sshd_server"]


def pytest_configure(config):
    """Once per pytest run, in the controller: the project's bytecode, written where Python looks for it.

    A subprocess (a CLI run, a ddp rank, the app's child) would otherwise compile every module of the
    engine again when the environment sets PYTHONDONTWRITEBYTECODE (CI's does): about 0.3 s of CPU each,
    hundreds of times a run. Python reads bytecode that is there even then; compileall writes it."""
    if not hasattr(config, "workerinput"):
        root = Path(__file__).resolve().parents[1]
        for folder in ("engine", "gui", "bench"):
            compileall.compile_dir(root / folder, quiet=1)
    warm_cli.install()  # the CLI's subprocesses forked from a pre-imported server (tests/warm_cli.py)


@pytest.fixture(autouse=True)
def _cold_start(request):
    """A test marked ``cold_start`` starts its ``multilane`` subprocesses as fresh interpreters."""
    warm_cli.set_cold(request.node.get_closest_marker("cold_start") is not None)
    yield
    warm_cli.set_cold(False)


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
def make_window(qtbot, tmp_path):
    """Makes the app's main window, offscreen, with its own settings file and runs folder: on
    ``devices``, training in a separate process or in the app's thread; runs still going at the end of
    the test are stopped."""
    from multilane.gui.window.main_window import MainWindow
    from PySide6.QtCore import QSettings

    made = []

    def make(devices: tuple[str, ...] = ("cpu:0", "cpu:1"), separate: bool = False):
        w = MainWindow(QSettings(str(tmp_path / "settings.ini"), QSettings.IniFormat))
        qtbot.addWidget(w)
        w.form.editors["run.runs_dir"].widget.setText(str(tmp_path / "runs"))
        w.form.editors["telemetry.record_s"].widget.setText("0.2")
        w.devices.set_checked(list(devices))
        w.separate.setChecked(separate)
        w.confirm_close = lambda: "stop"  # a test that fails mid-run: no modal question at teardown
        # opening a run over an edited form asks first (a modal box; tests/gui/test_gui_state.py clicks it)
        w.ask_replace_form = lambda _name: True
        made.append(w)
        return w

    yield make
    for w in made:
        if w.is_running():
            w.run.stop_and_wait()


@pytest.fixture
def window(make_window):
    """Two CPU lanes, in the app's thread: quicker; tests/test_gui_child.py tests the child process."""
    return make_window()
