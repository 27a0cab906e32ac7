"""The commands whose tests start processes (``plan``, ``sweep``, ``sweep-worker --host``, ``train
--host A --host B``), run in the test's own process for the fast tier (every module at least
once): a plan of a small model, and bad input to each, which must be one line naming what is wrong,
exit 2, no traceback and nothing written. The slow tests of each command cover the real runs."""

from __future__ import annotations

import json

import pytest
from multilane.engine.cli.main import main
from multilane.engine.sweep.slots import split_slots


def one_line(capsys, argv: list[str]) -> str:
    code = main(argv)
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in captured.err + captured.out, captured.err
    return lines[0]


def test_plan_of_a_small_model_fits_in_ram_and_answers_in_json(capsys):
    assert main(["plan", "--task", "linear", "--devices", "cpu:0", "--batch-size", "8", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert plan["batch"] == 8 and plan["needs"][0]["name"] == "cpu"
    assert 0 < plan["needs"][0]["need"] < plan["needs"][0]["free"]


def test_bad_input_to_each_command_is_one_line_and_leaves_no_folder(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = one_line(capsys, ["sweep", "--task", "linear", "--param", "optim.lr=lots", "--sweeps-dir", "sw"])
    assert "--param" in line and "lots" in line
    line = one_line(capsys, ["sweep", "--task", "linear", "--param", "optim.lr=log:1e-4:1e-1",
                             "--devices", "cpu:0,cpu:1,cpu:2", "--per-trial", "2", "--sweeps-dir", "sw"])  # fmt: skip
    assert "cpu:2 would be left over" in line
    line = one_line(capsys, ["sweep-worker", "--host", "h", "--storage", str(tmp_path / "j.log"), "--study", "s"])
    assert "--storage" in line or "journal" in line.lower() or "shared" in line.lower()
    line = one_line(capsys, ["train", "--host", "a=cpu:0", "--host", "b=cpu:0", "--remote-runs-dir", "x",
                             "--remote-runs-dir", "y", "--remote-runs-dir", "z"])  # fmt: skip
    assert "--remote-runs-dir is given 3 times for 2 hosts" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("devices", "per_trial", "slots"),
    [("cpu:0,cpu:1,cpu:2,cpu:3", 2, ["cpu:0,cpu:1", "cpu:2,cpu:3"]), ("cpu:0,cpu:1", 1, ["cpu:0", "cpu:1"])],
)
def test_devices_split_into_slots_of_per_trial(devices, per_trial, slots):
    assert split_slots(devices, per_trial) == slots
