"""The app's side of real data: path pickers and workers in the form, the LM's text sample in the window."""

from pathlib import Path

import pytest

pytest.importorskip("PySide6")

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QFileDialog, QLineEdit, QToolButton


@pytest.fixture
def window(make_window):
    return make_window(devices=("cpu:0",), separate=True)


def test_the_data_tasks_paths_have_pickers_and_workers_default_to_auto(qtbot, window, tmp_path, monkeypatch):
    form = window.form
    workers = form.editors["data.workers"]
    assert workers.widget.specialValueText() == "auto" and workers.get() is None
    workers.widget.setValue(2)
    assert workers.get() == 2
    form.set_task("charlm")
    path = window.findChild(QLineEdit, "task.params.path")
    browse = window.findChild(QToolButton, "task.params.path.browse")
    assert path is not None and browse is not None
    corpus = tmp_path / "text.txt"
    corpus.write_text("hello\n")
    monkeypatch.setattr(QFileDialog, "getOpenFileName", lambda *a, **k: (str(corpus), ""))
    qtbot.mouseClick(browse, Qt.LeftButton)
    assert path.text() == str(corpus) and form.param_editors["path"].get() == str(corpus)
    form.set_task("imagefolder")
    assert "path" not in form.param_editors
    root_browse = window.findChild(QToolButton, "task.params.root.browse")
    assert root_browse is not None
    monkeypatch.setattr(QFileDialog, "getExistingDirectory", lambda *a, **k: str(tmp_path))
    qtbot.mouseClick(root_browse, Qt.LeftButton)
    assert form.param_editors["root"].get() == str(tmp_path)


@pytest.mark.slow
def test_a_charlm_run_in_the_app_shows_the_models_text(qtbot, window, tmp_path):
    corpus = tmp_path / "text.txt"
    corpus.write_text("abc abc abc.\n" * 50)
    form = window.form
    form.set_task("charlm", {"path": str(corpus), "context": 16, "layers": 1, "width": 16, "heads": 2})
    form.editors["data.workers"].widget.setValue(0)
    form.editors["train.steps"].widget.setValue(6)
    form.editors["train.eval_every"].widget.setValue(3)
    assert window.validate() == []
    window.start()
    qtbot.waitUntil(lambda: window.is_running(), timeout=10_000)
    qtbot.waitUntil(lambda: not window.is_running(), timeout=120_000)
    assert window.last_result["status"] == "finished"
    assert window.note_label.toolTip().startswith("Sample at step 6: ")  # beside the run's state, not over it
    samples = Path(window.last_result["run_dir"]) / "samples.txt"
    assert samples.read_text().count("--- step ") == 2
