"""The Sweep tab as a user sees it, on a real X server: live, after the sweep was killed and reopened, and
finished (the README's screenshot).

    Xvfb :99 -screen 0 1920x1080x24 &
    DISPLAY=:99 python bench/gui_sweep_screenshots.py --size 1280x800 --out docs/

A digits sweep of 4 trials on two CPU lanes (one trial a lane): a screenshot while two trials train
(``-live``); then kill -9 of the sweep and its trials (their process group), the folder reopened in a
new window (``-killed``: the lost trials, "Resume sweep"); Resume sweep to the end, the best trial
selected (``<prefix>.png``). Each screenshot is the window as the X server has it.
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
from pathlib import Path

import pyqtgraph as pg
from gui_screenshots import shot, wait
from multilane.gui.window.main_window import MainWindow
from PySide6.QtCore import QSettings
from PySide6.QtWidgets import QApplication


def make_window(tmp: Path, w: int, h: int, steps: int) -> MainWindow:
    window = MainWindow(QSettings(str(tmp / "settings.ini"), QSettings.IniFormat))
    window.resize(w, h)
    window.move(0, 0)
    window.show()
    window.form.editors["run.runs_dir"].widget.setText(str(tmp / "runs"))
    window.devices.set_checked(["cpu:0", "cpu:1"])
    window.form.set_task("digits")
    window.form.editors["train.steps"].widget.setValue(steps)
    window.form.editors["train.log_every"].widget.setValue(5)
    window.form.editors["train.eval_every"].widget.setValue(25)
    window.tabs.setCurrentWidget(window.sweep_tab)
    return window


def select(tab, number: int) -> None:
    tab.table.clearSelection()
    for i in range(tab.table.rowCount()):
        if tab._number_at(i) == number:
            tab.table.selectRow(i)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="1280x800")
    ap.add_argument("--out", default="docs")
    ap.add_argument("--prefix", default="screenshot-sweep")
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    w, h = (int(v) for v in args.size.split("x"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    app = pg.mkQApp("Multilane")
    tmp = Path(tempfile.mkdtemp(prefix="multilane-sweep-shots-"))
    window = make_window(tmp, w, h, args.steps)
    tab = window.sweep_tab
    tab.space.table.setRowCount(0)
    tab.space.add_row("optim.lr", "log", "0.001:0.03")
    tab.space.add_row("task.params.hidden", "int", "16:64")
    tab.trials.setValue(4)
    tab.seed.setText("1")
    tab.pruner.setCurrentText("none")
    tab.folder.setText(str(tmp / "sweeps"))
    wait(app, 1.0)
    shot(app, window, out / f"{args.prefix}-new.png")
    assert tab.start(), tab.why.text()

    def training() -> bool:  # the tab polls once a second on its own
        return sum(r["state"] == "running" and (r["step"] or 0) >= 30 for r in tab._rows) >= 2

    wait(app, 600, until=training)
    print(tab.state.text(), [(r["state"], r["step"]) for r in tab._rows], flush=True)
    select(tab, 0)
    wait(app, 1.5)
    shot(app, window, out / f"{args.prefix}-live.png")

    folder = str(tab.sweep.folder)
    os.killpg(tab.process.proc.pid, signal.SIGKILL)  # the sweep and its trials, as a crash would
    tab.process.proc.wait(30)
    tab.timer.stop()
    window.close()
    wait(app, 1.0)

    window = make_window(tmp, w, h, args.steps)
    tab = window.sweep_tab
    tab.open_sweep(folder)
    wait(app, 1.5)
    shot(app, window, out / f"{args.prefix}-killed.png")
    print(tab.state.text(), "·", tab.start_btn.text())

    assert tab.start_btn.text() == "Resume sweep" and tab.start()
    wait(app, 900, until=lambda: tab.sweep is not None and not tab.running())
    tab.poll()
    best = next(r["number"] for r in tab._rows if r["is_best"])
    select(tab, best)
    wait(app, 1.5)
    shot(app, window, out / f"{args.prefix}.png")
    print(tab.state.text())
    window.close()
    QApplication.processEvents()


if __name__ == "__main__":
    main()
