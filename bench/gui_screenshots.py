"""The README's screenshots, made the way a user sees the app: a real window on an X server.

    Xvfb :99 -screen 0 1920x1080x24 &
    DISPLAY=:99 python bench/gui_screenshots.py --size 1400x900 --out docs/

Trains digits on two CPU lanes (screenshot mid-run and at the end), compares it with a second run,
and shows the runs table (``--task-form causal-lm``: only the form of that task, filled in as a user
would, in ``<prefix>-causal-lm-form.png``); each screenshot is the whole screen's framebuffer, window decorations
and all, as the X server has it.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import pyqtgraph as pg
from multilane.gui.window.main_window import MainWindow
from PySide6.QtCore import QSettings
from PySide6.QtWidgets import QApplication


def wait(app, seconds: float, until=None) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        app.processEvents()
        if until is not None and until():
            return
        time.sleep(0.02)


def shot(app, window, path: Path) -> None:
    wait(app, 0.6)
    screen = app.primaryScreen()
    g = window.frameGeometry()
    screen.grabWindow(0, g.x(), g.y(), g.width(), g.height()).save(str(path))
    print(path)


def open_window(size: str, runs_dir: str | None = None) -> tuple[QApplication, MainWindow, Path]:
    """The app's window at ``size`` ("1400x900") on the screen's corner, with settings of its own and
    ``runs_dir`` (default: a new temporary one); the app, the window and the temporary folder."""
    w, h = (int(v) for v in size.split("x"))
    app = pg.mkQApp("Multilane")
    tmp = Path(tempfile.mkdtemp(prefix="multilane-shots-"))
    window = MainWindow(QSettings(str(tmp / "settings.ini"), QSettings.IniFormat))
    window.resize(w, h)
    window.move(0, 0)
    window.show()
    window.form.editors["run.runs_dir"].widget.setText(runs_dir or str(tmp / "runs"))
    return app, window, tmp


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="1400x900")
    ap.add_argument("--out", default="docs")
    ap.add_argument("--prefix", default="screenshot")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--task-form", metavar="TASK", help="only the form of this task, filled in (causal-lm)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    app, window, _ = open_window(args.size)
    if args.task_form:
        task_form_shot(app, window, args.task_form, out / f"{args.prefix}-{args.task_form}-form.png")
        return
    window.devices.set_checked(["cpu:0", "cpu:1"])
    window.form.set_task("digits")
    window.form.editors["train.steps"].widget.setValue(args.steps)
    window.form.editors["train.log_every"].widget.setValue(5)
    window.form.editors["train.eval_every"].widget.setValue(50)
    window.form.editors["run.name"].widget.setText("lr3e-3")
    wait(app, 1.0)
    shot(app, window, out / f"{args.prefix}-start.png")
    window.start()
    wait(app, 120, until=lambda: window.plots.data.train.rows * 5 >= args.steps // 2)
    window.plots.show_values_at(args.steps // 4)
    shot(app, window, out / f"{args.prefix}-during.png")
    window.plots.clear_values()
    wait(app, 300, until=lambda: not window.is_running())
    first = window.last_result["run_dir"]
    shot(app, window, out / f"{args.prefix}.png")
    window.form.editors["optim.lr"].widget.setText("0.0005")
    window.form.editors["run.name"].widget.setText("lr5e-4")
    window.validate()
    window.start()
    wait(app, 300, until=lambda: not window.is_running())
    window.compare_runs([first, window.last_result["run_dir"]])
    shot(app, window, out / f"{args.prefix}-compare.png")
    window.tabs.setCurrentWidget(window.runs_table)
    shot(app, window, out / f"{args.prefix}-runs.png")
    window.export(str(out / f"{args.prefix}-export"), ["png", "svg", "pdf", "csv"], 1400)
    window.close()
    QApplication.processEvents()


CAUSAL_LM = {
    "model": "/data/models/SmolLM2-135M",
    "data": "/data/text/notes.txt, /data/text/chats",
    "context": 512,
    "lora_rank": 16,
    "lora_alpha": "32",
    "lora_targets": "q_proj, v_proj",
    "dtype": "bfloat16",
}


def task_form_shot(app, window, task: str, path: Path) -> None:
    """The task's form filled in as a user would (causal-lm: a model folder, data, LoRA), then its shot."""
    window.form.set_task(task)
    for name, value in (CAUSAL_LM if task == "causal-lm" else {}).items():
        ed = window.form.param_editors[name]
        ed.set(value) if not isinstance(value, str) or ed.kind != "list" else ed.widget.setText(value)
    window.form.param_editors["model"].widget.setFocus()
    shot(app, window, path)
    window.close()
    QApplication.processEvents()


if __name__ == "__main__":
    main()
