"""The app's Sweep tab, offscreen, with a real `multilane sweep` child process: start a sweep of the Setup
form's config, prune one trial and stop another from the trials table, see their curves compared in the
plots, export the table (CSV) and the sweep figures (PNG/SVG/PDF); an unfinished sweep reopened resumes."""

import csv
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(1800)


def _select(tab, number):
    tab.table.clearSelection()
    (row,) = [i for i in range(tab.table.rowCount()) if tab._number_at(i) == number]
    tab.table.selectRow(row)


@pytest.mark.slow
def test_sweep_tab_prunes_and_stops_trials_from_its_table_and_exports_the_sweep(make_window, qtbot, tmp_path):
    w = make_window(("cpu:0", "cpu:1"))
    w.form.set_task("digits")
    for key, value in (("train.steps", 20000), ("train.log_every", 5), ("train.eval_every", 5)):
        w.form.editors[key].widget.setValue(value)
    tab = w.sweep_tab
    w.tabs.setCurrentWidget(tab)
    tab.trials.setValue(2)
    tab.folder.setText(str(tmp_path / "sweeps"))
    tab.pruner.setCurrentText("none")
    assert w.config_dict()["train"]["steps"] == 20000
    assert tab.validate() is None
    assert tab.start()
    try:
        _prune_stop_compare_export(w, tab, qtbot, tmp_path)
    finally:
        if tab.process is not None and tab.process.running():
            tab.process.proc.kill()  # its trials die with it (PR_SET_PDEATHSIG)
            tab.process.proc.wait(30)


def _prune_stop_compare_export(w, tab, qtbot, tmp_path):
    def both_training():
        tab.poll()
        rows = {r["number"]: r for r in tab._rows}
        return len(rows) == 2 and all(r["state"] == "running" and (r["step"] or 0) >= 5 for r in rows.values())

    qtbot.waitUntil(both_training, timeout=600_000)
    _select(tab, 1)
    assert tab.request_selected("prune") == [1]
    _select(tab, 0)
    assert tab.request_selected("stop") == [0]
    qtbot.waitUntil(lambda: (tab.poll(), not tab.running())[1], timeout=600_000)
    tab.poll()
    states = {r["number"]: r["state"] for r in tab._rows}
    assert states == {0: "failed", 1: "pruned"}
    assert next(r for r in tab._rows if r["number"] == 0)["error"] == "stopped by hand"
    for r in tab._rows:  # ordinary run folders, stopped early with a checkpoint
        status = json.loads((Path(r["run_dir"]) / "status.json").read_text())
        assert status["state"] == "stopped" and status["step"] < 20000

    # Selecting both trials shows their curves compared in the plots.
    tab.table.selectAll()
    assert tab.show_selected()
    assert len(w.plots.overlays) == 1

    written = tab.export(str(tmp_path / "out"))
    assert {p.name for p in written} == {"trials.csv", "sweep.png", "sweep.svg", "sweep.pdf"}
    rows = list(csv.DictReader((tmp_path / "out" / "trials.csv").read_text().splitlines()))
    assert [r["state"] for r in rows] == ["failed", "pruned"] and "optim.lr" in rows[0]
    assert (tmp_path / "out" / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<text" in (tmp_path / "out" / "sweep.svg").read_text()  # real text, as the loss export

    # Its trials ended by hand, the sweep is finished (2 of 2); reopened, the tab shows its settings.
    assert tab.open_sweep(str(tab.sweep.folder))
    assert tab.space.specs() == ["optim.lr=log:0.0001:0.1"]
    assert tab.start_btn.text() == "Start sweep"
