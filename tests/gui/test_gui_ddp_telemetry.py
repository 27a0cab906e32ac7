"""A ddp run's telemetry in the app and its CSV: each rank writes records holding only its own
devices, and a rank's record can reach metrics.jsonl after a later record of another rank. A real
two-rank Gloo run writes the folder; the window (offscreen) and the CSV export read it."""

from __future__ import annotations

import csv
import math
import subprocess
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("PySide6")

from helpers import CLI
from multilane.gui.runs.run_data import RunData


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory) -> Path:
    runs = tmp_path_factory.mktemp("ddp_runs")
    args = [*CLI, "train", "--strategy", "ddp", "--task", "mlp", "--devices", "cpu:0,cpu:1", "--steps", "150"]
    args += ["--runs-dir", str(runs), "--set", "train.log_every=10", "--set", "telemetry.record_s=0.1"]
    subprocess.run(args, check=True, capture_output=True, timeout=180)
    (run,) = [p for p in runs.iterdir() if p.is_dir()]
    return run


def rank_devices(data: RunData) -> list[str]:
    devices = sorted(k.split("/", 1)[1] for k in data.telemetry.names("util/"))
    assert len(devices) == 2 and all("/rank" in d for d in devices), devices
    return devices


@pytest.mark.slow
def test_every_ranks_utilization_and_memory_are_drawn(qtbot, window, ddp_run):
    window.open_run(str(ddp_run))
    plots = window.plots
    plots.refresh()
    for dev in rank_devices(plots.data):
        for key in (f"util/{dev}", f"rss/{dev}"):
            _x, y = plots._curves[key].getData()
            assert y is not None and np.isfinite(y).sum() >= 2, key  # a line, not NaN-broken dots


def test_the_csv_gives_every_row_each_ranks_latest_telemetry(ddp_run, tmp_path):
    data = RunData.from_run_dir(ddp_run)
    devices = rank_devices(data)
    out = tmp_path / "run.csv"
    data.write_csv(out)
    rows = list(csv.DictReader(out.open()))
    last = rows[-1]
    for dev in devices:
        assert last[f"util/{dev}"] != "" and math.isfinite(float(last[f"util/{dev}"])), dev
        assert last[f"rss/{dev}"] != ""


def test_the_exported_figure_draws_every_ranks_utilization_and_memory(ddp_run):
    from multilane.gui.plots.overview import overview_figure

    data = RunData.from_run_dir(ddp_run)
    fig = overview_figure(data)
    axes = {ax.get_title(loc="left"): ax for ax in fig.axes if ax.get_visible()}
    for title in ("Utilization", "Memory"):
        lines = axes[title].get_lines()
        assert len(lines) == 2, title  # one per rank
        for line in lines:
            assert np.isfinite(np.asarray(line.get_ydata(), float)).sum() >= 2, (title, line.get_label())
