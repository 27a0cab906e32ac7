"""The app's File > Follow run on hostile or damaged run folders. A damaged record never
reaches a slot (pytest-qt fails a test on an exception in one), a finished run is shown finished, and
a FIFO where a run file belongs ends the follow, saying why, instead of "Following…" for ever."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

pytest.importorskip("PySide6")

from multilane.engine.config import build_config
from multilane.engine.run.trainer import Trainer


@pytest.fixture
def window(make_window):
    return make_window(separate=True)


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    runs = tmp_path_factory.mktemp("runs")
    cfg = build_config(
        {
            "task": {"name": "linear"},
            "devices": {"use": "cpu:0"},
            "train": {"steps": 6, "log_every": 1, "eval_every": 3},
            "telemetry": {"record_s": 0.2},
            "run": {"runs_dir": str(runs), "name": "f"},
        }
    )
    return Trainer(cfg).run().run_dir


HOSTILE = [
    '{"kind":"telemetry","wall_time":1.0,"step":5,"devices":{"cpu:0":{"busy_pct":"x"}}}',
    '{"kind":"telemetry","wall_time":1.0,"step":5,"devices":{"cpu:0":{"busy_pct":{"mean":"x"}}}}',
    '{"kind":"event","event":"warning","step":5}',
    '{"kind":"event","event":"warning","step":5,"message":7}',
    '{"kind":"eval","step":5,"val_loss":1.0,"sample":5}',
    '{"kind":"train","step":5,"loss":"abc"}',
    '{"kind":"train","step":5,"loss":NaN,"device_loss":{"cpu:0":"x"}}',
    "[" * 100_000 + "]" * 100_000,
]


def test_following_a_run_with_hostile_records_shows_it_finished(qtbot, window, finished, tmp_path):
    run = Path(shutil.copytree(finished, tmp_path / "run"))
    text = (run / "metrics.jsonl").read_text().splitlines()
    # the hostile lines inside the run, before its last records
    (run / "metrics.jsonl").write_text("\n".join([*text[:-2], *HOSTILE, *text[-2:]]) + "\n")
    assert window.follow_run(str(run))
    qtbot.waitUntil(lambda: not window.is_running(), timeout=60_000)
    assert window.last_result["status"] == "finished", window.last_result
    assert window.last_result["step"] == 6


@pytest.mark.parametrize("name", ["metrics.jsonl", "status.json"])
def test_following_a_run_whose_file_is_a_fifo_ends_saying_so(qtbot, window, finished, tmp_path, name):
    run = Path(shutil.copytree(finished, tmp_path / "run"))
    (run / name).unlink()
    os.mkfifo(run / name)
    assert window.follow_run(str(run))
    qtbot.waitUntil(lambda: not window.is_running(), timeout=60_000)  # it used to stay "Following…"
    result = window.last_result
    assert result["status"] == "detached", result
    assert "FIFO" in result["message"] and name in result["message"]
    assert "FIFO" in window.status_label.text()
