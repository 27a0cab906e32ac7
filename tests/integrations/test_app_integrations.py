"""The app with the integrations: it follows a Lightning run live and stops it; it opens a TensorBoard
logdir (following it while it grows, exporting it, writing nothing into it); the form has the
``train.tensorboard`` box."""

import pytest

pytest.importorskip("PySide6")

from integration_runs import records, run_folder, start_script, status
from torch.utils.tensorboard import SummaryWriter


@pytest.mark.slow
def test_the_app_follows_a_lightning_run_live_and_its_stop_ends_it(qtbot, make_window, tmp_path):
    window = make_window(separate=True)
    proc = start_script("lightning_script.py", tmp_path, "--steps", "400", "--sleep", "0.3")
    try:
        run = run_folder(tmp_path)
        assert window.follow_run(str(run))
        qtbot.waitUntil(lambda: window.plots.data.train.rows >= 3, timeout=120_000)
        assert window.plots.data.devices == ["cpu:0"]
        steps = window.plots.data.train.get("step").tolist()
        assert steps == list(range(1, len(steps) + 1))
        window.stop()  # through the run folder's control file
        qtbot.waitUntil(lambda: not window.is_running(), timeout=120_000)
        assert proc.wait(timeout=120) == 0
    finally:
        proc.kill()
    assert window.last_result["status"] == "stopped" == status(run)["state"]
    assert window.plots.data.train.rows == len(records(run, "train"))
    window.runs_table.load(str(tmp_path / "runs"))  # the runs table finds it, whole
    (row,) = window.runs_table.rows
    assert (row.task, row.devices, row.status, row.optimizer, row.notes) == (
        "lightning:Regression",
        "cpu:0",
        "stopped",
        "sgd",
        [],
    )


def snapshot(folder) -> dict:
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.iterdir())}


@pytest.mark.slow
def test_open_a_tensorboard_logdir_follow_it_and_export_it_without_writing_into_it(qtbot, window, tmp_path):
    logdir = tmp_path / "tb" / "run1"
    w = SummaryWriter(str(logdir))
    for step in range(5):
        w.add_scalar("train_loss", 1.0 / (step + 1), step)
        w.add_scalar("val_loss", 2.0 / (step + 1), step)
    w.flush()
    assert window.open_tensorboard(str(logdir))
    qtbot.waitUntil(lambda: window.plots.data.train.rows == 5, timeout=20_000)
    assert window.plots.data.eval.rows == 5
    for step in range(5, 9):
        w.add_scalar("train_loss", 1.0 / (step + 1), step)
    w.close()
    qtbot.waitUntil(lambda: window.plots.data.train.rows == 9, timeout=20_000)
    assert window.plots.data.train.get("loss").tolist() == pytest.approx([1 / (s + 1) for s in range(9)], rel=1e-6)
    before = snapshot(logdir)
    files = window.export(str(tmp_path / "exported"), ["png", "csv"], 800)
    assert {f.name for f in files} >= {"loss.png", "metrics.csv"}
    assert (tmp_path / "exported" / "loss.png").stat().st_size > 5_000
    assert len((tmp_path / "exported" / "metrics.csv").read_text().splitlines()) == 1 + 9
    window.tensorboard_view.poll()
    assert snapshot(logdir) == before, "nothing written into the logdir"
    assert window.shown_run_dir is None


def test_a_tensorboard_logdir_s_later_scalars_reach_the_plots_until_another_run_is_shown(qtbot, window, tmp_path):
    # fast tier (every module): the view's poll (gui/runs/tensorboard_view.py) called as its
    # timer calls it, without waiting a second for the timer; the test above lets the timer drive it
    from multilane.gui.runs.run_data import RunData

    logdir = tmp_path / "tb" / "run1"
    w = SummaryWriter(str(logdir))
    for step in range(3):
        w.add_scalar("train_loss", 1.0 / (step + 1), step)
    w.flush()
    assert window.open_tensorboard(str(logdir))
    view = window.tensorboard_view
    assert view.timer.isActive() and window.plots.data is view.data
    # the last step read waits one poll (another of its tags may still come): then it is drawn
    assert window.plots.data.train.rows == 2 and view.poll() == 1 and window.plots.data.train.rows == 3
    assert view.poll() == 0  # nothing new
    for step in range(3, 7):
        w.add_scalar("train_loss", 1.0 / (step + 1), step)
        w.add_scalar("val_loss", 2.0 / (step + 1), step)
    w.flush()
    assert view.poll() == 6 and view.poll() == 2  # steps 3-5 (train and eval each), then step 6
    assert window.plots.data.train.get("loss").tolist() == pytest.approx([1 / (s + 1) for s in range(7)], rel=1e-6)
    assert window.plots.data.eval.rows == 4
    xs, ys = window.plots.loss.listDataItems()[0].getData()
    assert len(xs) == 7 and ys[-1] == pytest.approx(1 / 7, rel=1e-6)  # the curve on screen has the new points
    window.plots.reset(RunData("another"))  # the window shows something else: the view lets go
    w.add_scalar("train_loss", 0.01, 7)
    w.close()
    assert view.poll() == 0 and not view.timer.isActive()
    assert window.plots.data.train.rows == 0


def test_a_folder_without_event_files_is_refused_with_one_line(qtbot, window, tmp_path):
    from PySide6.QtCore import QTimer
    from PySide6.QtWidgets import QApplication

    said = []

    def answer() -> None:  # the real message box: read it, close it
        box = QApplication.activeModalWidget()
        if box is None:
            QTimer.singleShot(50, answer)
            return
        said.append(box.text())
        box.done(0)

    QTimer.singleShot(50, answer)
    assert not window.open_tensorboard(str(tmp_path))
    assert said and "holds no event files" in said[0] and "\n" not in said[0]


def test_the_form_has_the_tensorboard_box(window):
    editor = window.form.editors["train.tensorboard"]
    assert editor.kind == "bool"
    assert window.config_dict()["train"]["tensorboard"] is False
    editor.widget.setChecked(True)
    assert window.config_dict()["train"]["tensorboard"] is True
