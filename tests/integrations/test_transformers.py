"""Hugging Face ``Trainer`` with ``MultilaneCallback``: a tiny GPT-2 from a config, random tokens, a real process."""

import json
import time

import pytest
from integration_runs import last_train_step, records, run_folder, run_script, start_script, status
from multilane.engine.rundir.control_file import write_control
from multilane.engine.rundir.runlog import read_json

SCRIPT = "transformers_script.py"


def test_trainer_logs_become_the_run_folders_records_step_for_step(tmp_path):
    run = run_script(SCRIPT, tmp_path, "--steps", "8", "--samples", "30")  # batches of 4: the 8th holds 2
    history = json.loads((tmp_path / "out" / "log_history.json").read_text())
    logged = [h for h in history if "loss" in h]
    train = records(run, "train")
    assert [r["step"] for r in train] == [h["step"] for h in logged] == list(range(1, 9))
    for rec, h in zip(train, logged, strict=True):
        assert rec["loss"] == h["loss"] and rec["device_loss"] == {"cpu:0": h["loss"]}
        assert rec["lr"] == h["learning_rate"] and rec["grad_norm"] == h["grad_norm"] and rec["epoch"] == h["epoch"]
        samples = 2 if rec["step"] == 8 else 4  # the samples the step trained on, not the nominal batch
        assert rec["step_ms"] > 0 and rec["samples_per_s"] == pytest.approx(samples / (rec["step_ms"] / 1000))
    evals = [h for h in history if "eval_loss" in h]
    assert [(e["step"], e["val_loss"]) for e in records(run, "eval")] == [(h["step"], h["eval_loss"]) for h in evals]
    assert status(run)["state"] == "finished" and status(run)["total_steps"] == 8
    cfg = read_json(run / "config.json")
    assert cfg["task"]["name"] == "transformers:GPT2LMHeadModel" and cfg["data"]["batch_size"] == 4


@pytest.mark.slow
def test_a_stop_in_the_control_file_ends_the_trainer_within_a_step(tmp_path):
    proc = start_script(SCRIPT, tmp_path, "--steps", "400", "--sleep", "0.3")
    try:
        run = run_folder(tmp_path)
        end = time.monotonic() + 120
        while last_train_step(run) < 3 and time.monotonic() < end:
            time.sleep(0.1)
        seen = last_train_step(run)
        write_control(run, "stop")
        assert proc.wait(timeout=120) == 0, (tmp_path / "script.log").read_text(errors="replace")[-3000:]
    finally:
        proc.kill()
    last = records(run, "train")[-1]["step"]
    ran = int((tmp_path / "out" / "steps.txt").read_text())
    assert seen <= last <= seen + 2 and ran == last, "no step after the one that saw the stop"
    assert status(run)["state"] == "stopped" and status(run)["step"] == last


@pytest.mark.slow
def test_a_trainer_that_raises_ends_failed_with_its_traceback_and_status_follows_the_steps(tmp_path):
    # The script catches the exception and carries on: the run's end is recorded as train() raises,
    # not by the process's exit (a TrainerCallback never hears of an exception).
    run = run_script(SCRIPT, tmp_path, "--steps", "8", "--sleep", "0.3", "--crash-at", "7", "--catch")
    assert (tmp_path / "out" / "caught.txt").read_text() == "the user's bug at step 7", "the exception went on up"
    s = status(run)
    assert s["state"] == "failed" and s["message"] == "ValueError: the user's bug at step 7" and s["step"] == 6
    error = (run / "error.txt").read_text()
    assert error.startswith("Traceback") and "in on_step_begin" in error
    assert error.rstrip().endswith("ValueError: the user's bug at step 7")
    events = [r["event"] for r in records(run, "event")]
    assert events[0] == "started" and events[-1] == "failed"
    # While it trained (0.3 s a step), status.json said how far it was, not step 0.
    seen = [json.loads(line) for line in (tmp_path / "out" / "status_seen.jsonl").read_text().splitlines()]
    assert all(x["state"] == "running" and x["status_step"] <= x["step"] for x in seen)
    assert any(x["status_step"] >= 3 for x in seen), seen
