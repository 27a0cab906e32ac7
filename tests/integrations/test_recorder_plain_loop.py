"""The recorder the Lightning and Hugging Face callbacks write through (engine/integrations/recorder.py),
driven by a plain PyTorch loop in the test's process: the fast tier's run of it, where the
library tests start Lightning and Trainer scripts. The run folder holds the loop's own losses, its
status follows the loop, and a Stop written to the control file reaches the loop at the first step end
after the file's poll interval."""

from __future__ import annotations

import json
import time

import torch
from multilane.engine.rundir.control_file import ControlFile, write_control
from multilane.engine.rundir.runlog import read_metrics
from multilane.integrations.recorder import RunRecorder
from torch import nn


def test_a_plain_loop_s_losses_are_the_run_s_and_a_stop_reaches_it(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(32, 4, dtype=torch.float64)
    y = x.sum(1, keepdim=True).sin()
    rec = RunRecorder(tmp_path / "runs", "plain", telemetry=False)
    rec.open("torch", "plain loop", "cpu", total_steps=10, batch_size=32, optimizer=("sgd", 0.1))
    losses, stopped_at = [], None
    for step in range(1, 11):
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        rec.train(step, loss.item())
        if step == 4:
            write_control(rec.run_dir, "stop")
            time.sleep(ControlFile(rec.run_dir).every_s + 0.05)  # the file is polled every 0.25 s
        if rec.step_end(step, loss.item(), samples=32).stop:
            stopped_at = step
            break
    rec.finish("stopped" if stopped_at else "finished")
    assert stopped_at == 4  # written at step 4: read at that step's end
    recorded = [r["loss"] for r in read_metrics(rec.run_dir) if r.get("kind") == "train"]
    assert recorded == losses  # every step's own loss, as the loop computed it
    status = json.loads((rec.run_dir / "status.json").read_text())
    assert status["state"] == "stopped"
    config = json.loads((rec.run_dir / "config.json").read_text())
    assert config["data"]["batch_size"] == 32
