"""The Sweep tab as a sweep view, on the real window at 1280×800 (offscreen): while the tab is open the
right side is the sweep (trials table, parallel coordinates, importances; the selected trials' curves
under them), the sweep's own Start/Stop are in view and the run's buttons hidden; a sweep whose process
was killed, reopened, shows its lost trial and offers Resume sweep; the importance placeholder is drawn
whole; two sweeps started together keep their own base config."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from multilane.engine.sweep.space import parse_params
from multilane.engine.sweep.spec import SweepSpec
from multilane.engine.sweep.study import Sweep, worker_identity
from PySide6.QtCore import QPoint, QRect
from test_gui import configure, start_and_wait

pytestmark = pytest.mark.timeout(600)


def _in_view(window, widget) -> bool:
    """Shown, and wholly inside the window (not below the fold, not clipped by a parent)."""
    rect = QRect(widget.mapTo(window, QPoint(0, 0)), widget.size())
    return (
        widget.isVisible() and window.rect().contains(rect) and widget.visibleRegion().boundingRect() == widget.rect()
    )


def _killed_sweep(root: Path, run_dir: str) -> Path:
    """A sweep as a kill -9 leaves it: trial 0 complete (its run folder ``run_dir``), trial 1 still
    "running" in the study, its worker a real process that was killed."""
    spec = SweepSpec("linear", parse_params(["optim.lr=log:1e-3:1e-1"], "linear"), 3, pruner="none", seed=0)
    sweep = Sweep.create(spec, root)
    done = sweep.study.ask()
    done.suggest_float("optim.lr", 1e-3, 1e-1, log=True)
    done.set_user_attr("run_dir", run_dir)
    sweep.study.tell(done, 0.5)
    worker = subprocess.Popen(["sleep", "60"])
    started = psutil.Process(worker.pid).create_time()
    lost = sweep.study.ask()
    lost.suggest_float("optim.lr", 1e-3, 1e-1, log=True)
    for k, v in {**worker_identity(), "worker_pid": worker.pid, "worker_started": started}.items():
        lost.set_user_attr(k, v)
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    return sweep.folder


def _window(make_window, qtbot):
    w = make_window(("cpu:0",))
    w.resize(1280, 800)
    w.show()
    qtbot.waitExposed(w)
    return w


def test_the_sweep_tab_is_a_sweep_view_and_shows_a_killed_sweep_as_it_is(make_window, qtbot, tmp_path):
    w = _window(make_window, qtbot)
    folder = _killed_sweep(tmp_path / "sweeps", "")
    tab = w.sweep_tab

    assert not tab.view.isVisible() and w.run_view.isVisible() and _in_view(w, w.start_btn)
    w.tabs.setCurrentWidget(tab)
    assert tab.view.isVisible() and not w.run_view.isVisible(), "the right side is the sweep, not empty run plots"
    assert not w.run_bar.isVisible() and not w.start_btn.isVisible(), "the run's Start/Pause/Stop do not apply"
    for b in (tab.start_btn, tab.stop_btn, tab.open_btn):
        assert _in_view(w, b), f"{b.text()} is out of view at 1280×800"

    assert tab.open_sweep(str(folder))
    states = {r["number"]: r["state"] for r in tab._rows}
    assert states == {0: "complete", 1: "lost", 2: "waiting"}, "the dead trial is lost and its params re-queued"
    lost = next(r for r in tab._rows if r["number"] == 1)
    assert tab.sweep.study.get_trials()[2].system_attrs["fixed_params"] == lost["params"]
    assert "lost" in [tab.table.item(i, 1).text() for i in range(tab.table.rowCount())]
    assert ": stopped · 1 of 3 trials done · 1 lost (re-queued)" in tab.state.text()
    assert tab.start_btn.text() == "Resume sweep" and tab.start_btn.isEnabled()
    assert _in_view(w, tab.start_btn)

    # One finished trial: no importances yet, and the placeholder says so whole, inside its plot.
    qtbot.wait(50)
    label = tab.plots.placeholder
    assert label is not None and label.isVisible()
    box = tab.plots.bars.getViewBox().sceneBoundingRect()
    assert box.contains(label.sceneBoundingRect()), (label.sceneBoundingRect(), box)

    w.tabs.setCurrentWidget(w.runs_table)
    assert not tab.view.isVisible() and w.run_view.isVisible() and w.run_bar.isVisible()
    assert not w.plots.compact and w.plots.util.isVisible(), "every run plot again"


@pytest.mark.slow
def test_selected_trials_curves_show_under_the_sweep_and_the_form_stays(make_window, qtbot, tmp_path):
    w = _window(make_window, qtbot)
    configure(w, steps=20, log_every=2)
    run_dir = start_and_wait(qtbot, w)["run_dir"]
    tab = w.sweep_tab
    w.tabs.setCurrentWidget(tab)
    assert tab.open_sweep(str(_killed_sweep(tmp_path / "sweeps", run_dir)))
    assert not w.run_view.isVisible(), "no trial selected: no empty run plots"
    w.form.editors["train.steps"].widget.setValue(33)  # the form is the next sweep's base
    (row,) = [i for i in range(tab.table.rowCount()) if tab._number_at(i) == 0]
    tab.table.selectRow(row)
    assert w.run_view.isVisible() and tab.view.isVisible() and w.shown_run_dir == run_dir
    assert w.plots.data.train.rows == 10, "the trial's logged steps, drawn"
    plots = w.plots  # under the sweep: the loss alone, with the height the other plots had
    assert plots.compact and plots.loss.isVisible() and not plots.util.isVisible()
    assert plots.loss.geometry().height() > 0.6 * plots.height(), (plots.loss.geometry(), plots.height())
    assert w.config_dict()["train"]["steps"] == 33, "showing a trial's curves leaves the form as it was"
    tab.table.clearSelection()
    assert not w.run_view.isVisible()


@pytest.mark.slow
def test_two_sweeps_started_together_keep_their_own_base_config(make_window, tmp_path):
    from multilane.gui.sweep.process import SweepProcess

    w = make_window(("cpu:0",))
    root = tmp_path / "sweeps"
    settings = {"devices": "cpu:0", "trials": 1, "per_trial": 1, "objective": "val_loss:min", "sampler": "random",
                "pruner": "none", "seed": None, "storage": None}  # fmt: skip
    started = []
    for steps in (111, 222):
        w.form.editors["train.steps"].widget.setValue(steps)
        cfg = w.config_dict()
        started.append(SweepProcess.start(cfg, ["optim.lr=log:1e-3:1e-1"], {**settings, "name": f"s{steps}"}, root))
    try:
        end = time.monotonic() + 240
        while not all((p.folder() or Path("-")).joinpath("sweep.json").exists() for p in started):
            assert time.monotonic() < end and all(p.running() for p in started), [
                p.log_path.read_text() for p in started
            ]
            time.sleep(0.2)
    finally:
        for p in started:
            os.killpg(p.proc.pid, signal.SIGKILL)
            p.proc.wait(30)
            p.cleanup()
    bases = {json.loads((p.folder() / "sweep.json").read_text())["name"]: p for p in started}
    for steps in (111, 222):
        saved = json.loads((bases[f"s{steps}"].folder() / "sweep.json").read_text())
        assert saved["base"]["train"]["steps"] == steps
    assert not list(root.glob("*.config.json")), "the app's copies go once the sweeps hold their own"
