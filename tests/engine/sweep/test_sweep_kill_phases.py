"""kill -9 of a sweep at each phase of its work: asking a trial, between two parameters'
sampling, with every parameter sampled but nothing started, as the trial's process starts, and in the
middle of writing a trial's end to the journal (the phase mid-step is test_sweep_crash.py's). After
each, ``multilane sweep --resume`` opens the study, finds the lost trial, re-queues what it had, and
reaches the asked count; no trial is left RUNNING, no run folder says "running", no trial process is
left, and plain ``optuna.load_study`` opens the journal."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from sweep_helpers import TINY, load_journal, sweep_cli, sweep_folder

pytestmark = pytest.mark.timeout(900)
KILL_AT = str(Path(__file__).with_name("kill_at.py"))
PARAMS = ["--param", "optim.lr=log:1e-3:1e-2", "--param", "optim.momentum=float:0:0.9"]


def _trial_processes(folder: Path) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline", "environ"]):
        try:
            if any(str(folder) in a for a in (p.info["cmdline"] or [])) or str(folder) in json.dumps(
                p.info["environ"] or {}
            ):
                found.append(p)
        except (psutil.Error, TypeError):
            continue
    return [p for p in found if p.pid != os.getpid()]


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["asking", "sampling", "sampled", "trial-start", "storage"])
def test_a_sweep_killed_at_each_phase_resumes_to_its_count_leaving_nothing_running(tmp_path, phase):
    import optuna

    ts = optuna.trial.TrialState
    args = [*TINY, "--devices", "cpu:0", "--trials", "2", "--seed", "1", "--pruner", "none", "--no-table", *PARAMS]
    killed = subprocess.run(
        [sys.executable, KILL_AT, phase, *args, "--sweeps-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr + killed.stdout
    folder = sweep_folder(tmp_path)
    if phase == "storage":  # the torn record is there, as the kill left it
        assert not (folder / "study.journal").read_bytes().endswith(b"\n")

    end = time.monotonic() + 300  # the trial started at trial-start ends with its sweep (its parent-death signal)
    while _trial_processes(folder) and time.monotonic() < end:
        time.sleep(0.3)
    assert not _trial_processes(folder)

    r = sweep_cli("sweep", "--resume", str(folder), "--devices", "cpu:0", "--no-table")
    assert r.returncode == 0, r.stderr + r.stdout
    assert "trials 1 had lost their process" in r.stdout or "trials 0 had lost their process" in r.stdout, r.stdout
    if phase == "storage":
        assert "its last record was cut short" in r.stderr and "bytes dropped, kept in" in r.stderr, r.stderr
        assert list(folder.glob("study.journal.*")), "the dropped bytes are kept beside the journal"
    trials = load_journal(folder).trials  # plain Optuna opens the journal
    assert not [t.number for t in trials if t.state in (ts.RUNNING, ts.WAITING)]
    assert len([t for t in trials if t.state in (ts.COMPLETE, ts.PRUNED)]) == 2  # the asked count
    lost = [t for t in trials if t.user_attrs.get("lost")]
    assert len(lost) == 1  # the killed trial: lost, not counted
    again = [t for t in trials if t.user_attrs.get("requeued_from") == lost[0].number]
    if phase == "asking":  # nothing drawn yet: nothing to run again
        assert not lost[0].params and not again
    else:  # what it had drawn is run again as it was (at "sampling", the one parameter drawn; the other anew)
        assert len(again) == 1 and again[0].state == ts.COMPLETE
        assert {k: again[0].params[k] for k in lost[0].params} == lost[0].params
        assert len(lost[0].params) == (1 if phase == "sampling" else 2)
    for t in trials:
        status = Path(t.user_attrs.get("run_dir", "")) / "status.json"
        if t.user_attrs.get("run_dir") and status.is_file():
            assert json.loads(status.read_text())["state"] != "running", (t.number, status.read_text())
    assert not _trial_processes(folder)
