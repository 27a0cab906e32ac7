"""The window's export runs in a process of its own, with a progress bar and Cancel (on the
GUI thread it froze the window for ~95 s). Real window, real export process, real files."""

import os
import time

import numpy as np
import pytest

pytest.importorskip("PySide6")

from multilane.gui.runs.run_data import RunData
from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QPushButton


def big_run(n: int, name: str = "big") -> RunData:
    """A run of ``n`` logged steps on two lanes, with telemetry beside them."""
    d = RunData(name)
    d.add({"kind": "event", "event": "started", "step": 0, "wall_time": 1000.0, "lanes": ["cpu:0", "cpu:1"]})
    rng = np.random.default_rng(0)
    loss = 2.0 * np.exp(-np.arange(1, n + 1) / n) + 0.05 * rng.random(n)
    for k in range(n):
        t = 1000.0 + 0.01 * (k + 1)
        rec = {"kind": "train", "step": k + 1, "wall_time": t, "loss": loss[k], "lr": 0.01, "samples_per_s": 900.0}
        rec["device_loss"] = {"cpu:0": loss[k], "cpu:1": loss[k] * 1.01}
        d.add(rec)
        if k % 10 == 0:
            tele = {"cpu:0": {"busy_pct": {"mean": 40.0}}, "cpu:1": {"busy_pct": {"mean": 42.0}}}
            d.add({"kind": "telemetry", "step": k + 1, "wall_time": t, "devices": tele, "process": {"rss_mb": 300.0}})
    return d


@pytest.mark.slow
def test_a_background_export_writes_what_the_direct_one_does_and_the_window_keeps_answering(
    qtbot, make_window, tmp_path
):
    window = make_window()
    window.plots.reset(big_run(3000))
    ticks = []
    timer = QTimer()
    timer.timeout.connect(lambda: ticks.append(time.perf_counter()))
    timer.start(10)
    seen = []
    job = window.export_in_background(str(tmp_path / "out"), ["png", "csv"], width=800)
    job.progressed.connect(lambda done, total, what: seen.append((done, total, what)))
    assert job.dialog.isVisible() and job.dialog.labelText().startswith("Exporting")
    qtbot.waitUntil(lambda: job.result is not None, timeout=180_000)
    timer.stop()
    assert job.result["status"] == "done", job.result
    names = sorted(p.name for p in job.result["files"])
    assert names == ["loss.png", "metrics.csv", "plots.png"]
    assert sorted(os.listdir(tmp_path / "out")) == names  # no staging folder left behind
    direct = sorted(p.name for p in window.export(str(tmp_path / "direct"), ["png", "csv"], width=800))
    assert names == direct
    assert (tmp_path / "out" / "metrics.csv").read_text() == (tmp_path / "direct" / "metrics.csv").read_text()
    # progress: every part, in order, out of the same total
    assert [d for d, _, _ in seen] == list(range(len(seen))) and {t for _, t, _ in seen} == {3}
    assert [w for *_, w in seen][:3] == ["loss.png", "plots.png", "metrics.csv"]
    assert not job.dialog.isVisible()
    assert "Exported 3 files" in window.note_label.toolTip()
    # the event loop kept running meanwhile: the timer fired all along, not in one burst at the end
    assert len(ticks) > 20


@pytest.mark.slow
def test_cancel_stops_the_export_process_and_leaves_the_folder_as_it_was(qtbot, make_window, tmp_path):
    window = make_window()
    window.plots.reset(big_run(20_000))
    out = tmp_path / "out"
    out.mkdir()
    (out / "plots.png").write_bytes(b"an earlier export")
    job = window.export_in_background(str(out), ["png", "svg", "pdf", "csv"], width=1600)
    qtbot.waitUntil(lambda: job._proc is not None, timeout=60_000)
    pid = job._proc.pid
    cancel = next(b for b in job.dialog.findChildren(QPushButton) if b.text() == "Cancel")
    cancel.click()  # the progress dialog's own button
    qtbot.waitUntil(lambda: job.result is not None, timeout=60_000)
    assert job.result["status"] == "cancelled"
    assert sorted(os.listdir(out)) == ["plots.png"] and (out / "plots.png").read_bytes() == b"an earlier export"
    assert job._proc.poll() is not None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert "cancelled" in window.note_label.toolTip()


# fast (~1 s): the fast tier's run of gui/export/export_job.py
def test_an_export_that_cannot_write_says_so_in_one_line(qtbot, make_window, tmp_path):
    window = make_window()
    window.plots.reset(big_run(50))
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    job = window.export_in_background(str(blocker / "out"), ["csv"])
    # the job's own slot sets its result, the window's (queued after it) shows the box: wait for both
    qtbot.waitUntil(lambda: job.result is not None and hasattr(window, "error_box"), timeout=60_000)
    assert job.result["status"] == "error" and "\n" not in job.result["message"], job.result
    assert str(blocker) in window.error_box.text() and window.error_box.isVisible()
    window.error_box.close()


# fast (~1 s): the fast tier's run of gui/export/export_dialog.py
def test_the_export_dialog_asks_once_and_the_export_writes_only_what_was_chosen(
    qtbot, make_window, tmp_path, monkeypatch
):
    monkeypatch.setenv("HOME", str(tmp_path))
    window = make_window()
    window.plots.reset(big_run(50))
    window.settings.setValue("export_width", 900)  # the width chosen last time
    dialog = window.export_dialog()
    assert dialog.isVisible() and dialog.windowTitle() == "Export figures and metrics"
    assert dialog.folder.text() == str(tmp_path / "runs" / "export")  # no run folder shown: the runs folder's
    assert dialog.width.value() == 900 and dialog.chosen_formats() == ["png", "svg", "pdf", "csv"]
    for name in ("png", "svg", "pdf"):
        dialog.formats[name].setChecked(False)
    dialog.folder.setText("~/chosen")
    dialog.width.setValue(1200)
    dialog.accept()
    qtbot.waitUntil(lambda: "Exported" in window.note_label.text(), timeout=60_000)
    out = tmp_path / "chosen"
    assert sorted(p.name for p in out.iterdir()) == ["metrics.csv"]
    assert len((out / "metrics.csv").read_text().splitlines()) == 1 + 50
    assert window.settings.value("export_width", type=int) == 1200  # asked once: remembered for next time
