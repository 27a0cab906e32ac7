"""A language model's numbers where a user reads them: tokens/s (train records) and perplexity (eval records)
drawn in the window's plots (real Qt, offscreen), printed by ``multilane watch``, written by export (caption and
CSV) and shown in the Runs table; nothing of them for a run that logs none."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

pytest.importorskip("PySide6")

from multilane.engine.cli.watch import WatchState
from multilane.gui.plots.export import export_headless
from multilane.gui.plots.figures import run_caption
from multilane.gui.runs.run_data import RunData
from multilane.gui.table.runs_index import COLUMNS

TOKENS = [1210.0, 1390.5, 1402.25]
PPL = [61.5, 40.25]


def lm_run(runs, name: str, language: bool) -> object:
    """A finished run's folder as the engine leaves it; ``language``: its records carry tokens/s and perplexity."""
    run = runs / name
    run.mkdir(parents=True)
    config = {
        "task": {"name": "causal-lm" if language else "digits"},
        "devices": {"use": "cpu:0,cpu:1", "strategy": "replicate"},
        "data": {"batch_size": 8},
        "optim": {"name": "adamw", "lr": 0.001},
    }
    (run / "config.json").write_text(json.dumps(config))
    (run / "status.json").write_text(json.dumps({"state": "finished", "step": 30, "total_steps": 30}))
    records = [{"kind": "event", "event": "started", "step": 0, "wall_time": 1000.0, "lanes": ["cpu:0", "cpu:1"]}]
    for i, step in enumerate((10, 20, 30)):
        rec = {"kind": "train", "step": step, "wall_time": 1000.0 + step, "loss": 4.0 - i, "samples_per_s": 40.0 + i}
        rec["device_loss"] = {"cpu:0": 4.0 - i, "cpu:1": 4.1 - i}
        if language:
            rec["tokens_per_s"] = TOKENS[i]
        records.append(rec)
        if step in (20, 30):
            val = {"kind": "eval", "step": step, "wall_time": 1000.5 + step, "val_loss": 4.2 - i, "metrics": {}}
            if language:
                val["perplexity"] = PPL[i - 1]
            records.append(val)
    records.append({"kind": "event", "event": "finished", "step": 30, "wall_time": 1031.0})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


@pytest.fixture
def runs(tmp_path):
    return lm_run(tmp_path / "runs", "lm", True), lm_run(tmp_path / "runs", "plain", False)


def test_watch_and_export_print_tokens_per_s_and_perplexity_only_for_runs_that_log_them(runs, tmp_path):
    lm, plain = runs
    lines = {}
    for run in runs:
        state = WatchState()
        for line in (run / "metrics.jsonl").read_text().splitlines():
            state.add(json.loads(line))
        lines[run.name] = state.line(telemetry=False)
    assert "1,402 tokens/s" in lines["lm"] and "perplexity 40.2500" in lines["lm"], lines
    assert "tokens/s" not in lines["plain"] and "perplexity" not in lines["plain"], lines

    from multilane.engine.rundir.runlog import read_metrics
    from multilane.gui.runs.run_summary import summarize_records
    from multilane.gui.window.summary_view import summary_html

    summaries = {run.name: summary_html(summarize_records(read_metrics(run)), run.name) for run in runs}
    assert "<td>perplexity</td><td align=right>&nbsp;40.25&nbsp;</td>" in summaries["lm"], summaries["lm"]
    assert "perplexity" not in summaries["plain"]

    assert run_caption(lm).endswith("1,334 tokens/s · best perplexity 40.25")  # the mean of TOKENS
    assert "tokens/s" not in run_caption(plain) and "perplexity" not in run_caption(plain)
    for run in runs:
        (path,) = export_headless(run, tmp_path / f"out-{run.name}", ["csv"])
        rows = list(csv.DictReader(path.open()))
        if run is lm:
            assert [float(r["tokens_per_s"]) for r in rows] == TOKENS
            assert [r["metric/perplexity"] for r in rows][1:] == ["61.5", "40.25"]
        else:
            assert "tokens_per_s" not in rows[0] and "metric/perplexity" not in rows[0]


def test_the_window_draws_tokens_per_s_and_perplexity_and_the_runs_table_shows_them(qtbot, make_window, runs):
    from multilane.gui.plots.panel import PlotPanel

    lm, plain = runs
    panel = PlotPanel()
    qtbot.addWidget(panel)
    panel.resize(1280, 800)
    panel.show()
    qtbot.waitExposed(panel)
    for run in runs:
        panel.reset(RunData.from_run_dir(run))
        panel.refresh()
        qtbot.wait(30)
        title = panel.throughput.titleLabel.text
        x, y = panel._curves[panel.data.throughput_key].getData()
        if run is lm:
            assert "tokens/s" in title and list(x) == [10, 20, 30] and np.allclose(y, TOKENS)
            x, y = panel._curves["metric/perplexity"].getData()
            assert list(x) == [20, 30] and np.allclose(y, PPL)
            assert panel.metric_plot.isVisible() and "perplexity" in panel.metric_plot.titleLabel.text
        else:
            assert "samples/s" in title and np.allclose(y, [40.0, 41.0, 42.0])
            assert "metric/perplexity" not in panel._curves or not panel._curves["metric/perplexity"].isVisible()

    # Compared: tokens/s when every run logs them, else samples/s for every run (never both on one axis).
    for other, unit in ((lm, "tokens/s"), (plain, "samples/s")):
        panel.reset(RunData.from_run_dir(lm))
        panel.add_overlay(RunData.from_run_dir(other))
        panel.refresh()
        assert unit in panel.throughput.titleLabel.text
        key = "tokens_per_s" if unit == "tokens/s" else "samples_per_s"
        assert np.allclose(panel._curves[f"cmp0:{key}"].getData()[1], TOKENS if key == "tokens_per_s" else [40, 41, 42])

    w = make_window()
    w.resize(1600, 900)
    w.show()
    qtbot.waitExposed(w)
    w.tabs.setCurrentWidget(w.runs_table)
    table = w.runs_table.table
    w.runs_table.load(str(lm.parent))
    qtbot.waitUntil(lambda: table.rowCount() == 2)
    col = {key: c for c, (key, _) in enumerate(COLUMNS)}
    assert not table.isColumnHidden(col["tokens_per_s"]) and not table.isColumnHidden(col["best_perplexity"])
    cells = {
        table.item(r, col["name"]).text(): (
            table.item(r, col["tokens_per_s"]).text(),
            table.item(r, col["best_perplexity"]).text(),
        )
        for r in range(2)
    }
    assert cells == {"lm": ("1,334", "40.2500"), "plain": ("", "")}, cells
    import shutil

    shutil.rmtree(lm)  # no run of a language model left: its columns go
    w.runs_table.load(str(plain.parent))
    qtbot.waitUntil(lambda: table.rowCount() == 1)
    assert table.isColumnHidden(col["tokens_per_s"]) and table.isColumnHidden(col["best_perplexity"])
