"""The Health view's screenshots, on a real X server, as README and docs/health.md show them.

    Xvfb :99 -screen 0 1600x1000x24 &
    DISPLAY=:99 python bench/health_screenshots.py --out docs/

Trains digits on two CPU lanes with health sampled every 10 steps, opens the run and shows its Health
tab (the update-to-weight heatmap, hovered, and the noise scale beside the batch); then a run whose
data holds a NaN, with the place the NaN began marked on its loss plot.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import pyqtgraph as pg
import torch
from gui_screenshots import shot, wait
from multilane.engine.config import build_config
from multilane.engine.run.trainer import Trainer
from multilane.engine.tasks import ArrayData, Task
from multilane.gui.window.main_window import MainWindow
from PySide6.QtCore import QPointF, QSettings
from torch import nn


class NanData(Task):
    """Regression whose sample 300 holds a NaN: the run stops at the step that reads it."""

    name = "nan-data"

    def build_model(self):
        return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

    def data(self):
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(2000, 8, generator=g), torch.randn(2000, 1, generator=g)
        x[300, 3] = float("nan")
        return ArrayData(x, y), None

    def loss(self, output, target):
        return nn.functional.mse_loss(output, target)


def train(runs: Path, name: str, task: Task | None = None, **cfg) -> Path:
    base = {"run": {"runs_dir": str(runs), "name": name}, "devices": {"use": "cpu:0,cpu:1"}}
    t = Trainer(build_config(base | cfg), task=task)
    t.run()
    assert t.run_dir is not None
    return t.run_dir.path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="1400x900")
    ap.add_argument("--out", default="docs")
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    out = Path(args.out)
    tmp = Path(tempfile.mkdtemp(prefix="multilane-health-shots-"))
    healthy = train(
        tmp / "runs",
        "digits",
        train={"steps": args.steps, "log_every": 10, "eval_every": 100},
        health={"every": 10},
    )
    nan = train(
        tmp / "runs",
        "nan-data",
        NanData(),
        train={"steps": 60, "log_every": 5, "eval_every": 0},
        data={"batch_size": 32},
    )
    w, h = (int(v) for v in args.size.split("x"))
    app = pg.mkQApp("Multilane")
    window = MainWindow(QSettings(str(tmp / "settings.ini"), QSettings.IniFormat))
    window.resize(w, h)
    window.move(0, 0)
    window.show()
    window.open_run(str(healthy))
    window.views.setCurrentWidget(window.health_view)
    view = window.health_view
    view.quantity.setCurrentIndex(
        list(view.quantity.itemData(i) for i in range(view.quantity.count())).index("update_ratio")
    )
    wait(app, 1.0)
    # hover over the second row at two thirds of the run
    steps = view._steps
    target = view.heat.vb.mapViewToScene(QPointF(steps[2 * len(steps) // 3], 1))
    view._on_mouse(target)
    print("hover:", view.hover.text())
    print("noise:", view.noise_line.text())
    shot(app, window, out / "screenshot-health.png")
    window.open_run(str(nan))
    window.views.setCurrentWidget(window.plots)
    wait(app, 1.0)
    print("nan:", window.plots.data.nan_origin.get("message") if window.plots.data.nan_origin else None)
    shot(app, window, out / "screenshot-nan-origin.png")
    window.close()


if __name__ == "__main__":
    main()
