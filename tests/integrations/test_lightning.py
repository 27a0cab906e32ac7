"""Lightning with ``MultilaneCallback``: a real Lightning script, a tiny CPU model, as a real process."""

import json
import subprocess
import sys
import time

import pytest
from integration_runs import last_train_step, logged, records, run_folder, run_script, start_script, status
from multilane.engine.rundir.control_file import write_control
from multilane.engine.rundir.runlog import read_json

SCRIPT = "lightning_script.py"


@pytest.mark.slow
def test_lightning_run_folder_holds_every_step_the_trainer_logged_and_exports(tmp_path):
    run = run_script(SCRIPT, tmp_path, "--steps", "8")
    train = records(run, "train")
    mine = logged(tmp_path)
    assert [r["step"] for r in train] == [m["step"] for m in mine] == list(range(1, 9))
    assert [r["loss"] for r in train] == [m["loss"] for m in mine]  # exactly what training_step returned
    assert [r["device_loss"] for r in train] == [{"cpu:0": m["loss"]} for m in mine]
    # StepLR(step_size=2, gamma=0.5) stepping every step: the lr each step trained with
    assert [r["lr"] for r in train] == [0.05, 0.05, 0.025, 0.025, 0.0125, 0.0125, 0.00625, 0.00625]
    assert all(r["epoch"] == 0 and r["step_ms"] > 0 for r in train)
    assert all(r["samples_per_s"] == pytest.approx(16 / (r["step_ms"] / 1000)) for r in train)  # batch 16
    evals = records(run, "eval")
    assert [e["step"] for e in evals] == [4, 8]
    assert all(e["val_loss"] > 0 and set(e["metrics"]) == {"val_mae"} for e in evals)
    assert status(run)["state"] == "finished" and status(run)["step"] == 8
    events = [r["event"] for r in records(run, "event")]
    assert events[0] == "started" and events[-1] == "finished"
    cfg = read_json(run / "config.json")
    assert cfg["task"]["name"] == "lightning:Regression" and cfg["devices"]["use"] == "cpu:0"
    assert records(run, "telemetry"), "the engine's sampler watched the device"
    out = tmp_path / "figs"
    r = subprocess.run(
        [sys.executable, "-m", "multilane.engine.cli", "export", str(run), "--out", str(out), "--format", "png,csv"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stderr
    assert (out / "loss.png").stat().st_size > 10_000
    assert len((out / "metrics.csv").read_text().splitlines()) == 1 + 8


def rank1_telemetry(run) -> bool:
    try:
        return any("/rank1/cpu:1" in k for r in records(run, "telemetry") for k in r["devices"])
    except AssertionError:  # a record being written
        return False


@pytest.mark.slow
def test_lightning_ddp_on_two_cpu_processes_records_each_rank_and_stops_both_at_one_step(tmp_path):
    proc = start_script(SCRIPT, tmp_path, "--devices", "2", "--steps", "400", "--sleep", "0.15")
    try:
        run = run_folder(tmp_path)
        end = time.monotonic() + 120
        while not (last_train_step(run) >= 5 and rank1_telemetry(run)) and time.monotonic() < end:
            time.sleep(0.1)
        assert rank1_telemetry(run), "rank 1 samples its own device; rank 0 writes its records"
        seen = last_train_step(run)
        write_control(run, "stop")
        assert proc.wait(timeout=120) == 0, (tmp_path / "script.log").read_text(errors="replace")[-3000:]
    finally:
        proc.kill()
    train = records(run, "train")
    r0, r1 = logged(tmp_path, 0), logged(tmp_path, 1)
    last = train[-1]["step"]
    assert seen <= last <= seen + 3  # the stop came at the next step (the control file is polled every 0.25 s)
    assert len(r0) == len(r1) == last, "both ranks stopped at the same step"
    keys = list(train[0]["device_loss"])
    assert len(keys) == 2 and keys[0].endswith("/rank0/cpu:0") and keys[1].endswith("/rank1/cpu:1")
    for rec, a, b in zip(train, r0, r1, strict=True):
        assert rec["step"] == a["step"] == b["step"]
        assert rec["device_loss"] == {keys[0]: a["loss"], keys[1]: b["loss"]}
        assert rec["loss"] == pytest.approx((a["loss"] + b["loss"]) / 2, rel=1e-12)
        assert rec["samples_per_s"] == pytest.approx(32 / (rec["step_ms"] / 1000))  # 16 on each rank
    assert status(run)["state"] == "stopped" and status(run)["step"] == last
    assert read_json(run / "config.json")["devices"]["strategy"] == "ddp"


@pytest.mark.slow
def test_stop_in_the_control_file_saves_a_lightning_checkpoint_and_ends_within_a_step_pause_waits(tmp_path):
    proc = start_script(SCRIPT, tmp_path, "--steps", "400", "--sleep", "0.15", "--checkpoint", "--accumulate", "2")
    try:
        run = run_folder(tmp_path)
        end = time.monotonic() + 120
        while last_train_step(run) < 2 and time.monotonic() < end:
            time.sleep(0.1)
        write_control(run, "pause")
        while status(run)["state"] != "paused" and time.monotonic() < end:
            time.sleep(0.1)
        assert status(run)["state"] == "paused"
        held = len(logged(tmp_path))
        time.sleep(1.5)
        assert len(logged(tmp_path)) == held, "a paused run starts no step"
        write_control(run, "resume")
        while last_train_step(run) < held // 2 + 2 and time.monotonic() < end:
            time.sleep(0.1)
        seen = last_train_step(run)
        write_control(run, "stop")
        assert proc.wait(timeout=120) == 0, (tmp_path / "script.log").read_text(errors="replace")[-3000:]
    finally:
        proc.kill()
    train = records(run, "train")
    last = train[-1]["step"]
    micro = logged(tmp_path)
    assert seen <= last <= seen + 2 and len(micro) == 2 * last  # two micro-batches a step
    for rec in train:  # one record per optimizer step: the mean of its micro-batches' losses
        mine = [m["loss"] for m in micro if m["step"] == rec["step"]]
        assert len(mine) == 2 and rec["loss"] == pytest.approx(sum(mine) / 2, rel=1e-12)
    assert status(run)["state"] == "stopped"
    events = [r["event"] for r in records(run, "event")]
    assert events == ["started", "paused", "resumed", "checkpoint", "stopped"]
    ckpt = tmp_path / "out" / "lightning" / "checkpoints" / f"stopped-step={last}.ckpt"
    assert ckpt.is_file()
    import torch

    assert torch.load(ckpt, weights_only=False)["global_step"] == last


@pytest.mark.slow
def test_a_crashed_ddp_rank_s_own_error_is_the_runs_outcome_and_status_follows_the_steps(tmp_path):
    # Rank 1 raises at step 6; rank 0 then fails on gloo's "Connection closed by peer". The run folder
    # names rank 1's error and traceback.
    run = run_script(SCRIPT, tmp_path, "--devices", "2", "--steps", "40", "--sleep", "0.3", "--crash", "6:1", rc=1)
    s = status(run)
    assert s["state"] == "failed" and s["rank"] == 1 and s["step"] == 5
    assert s["message"].startswith("rank 1 (") and s["message"].endswith(
        "ValueError: the user's bug at step 6 on rank 1"
    )
    error = (run / "error.txt").read_text()
    assert "in training_step" in error and error.rstrip().endswith("ValueError: the user's bug at step 6 on rank 1")
    failed = [r for r in records(run, "event") if r["event"] == "failed"]
    assert len(failed) == 1 and failed[0]["rank"] == 1 and failed[0]["message"] == s["message"]
    # While it trained (0.3 s a step), status.json said how far it was, not step 0.
    seen = [json.loads(line) for line in (tmp_path / "out" / "status_seen.jsonl").read_text().splitlines()]
    assert all(x["status_step"] <= x["step"] for x in seen) and any(x["status_step"] >= 2 for x in seen), seen
