"""The log window's gradient norms: summed at log time, the same sum whether or not a checkpoint split
the window, and a checkpoint written before they were kept one by one still loads."""

import torch
from multilane.engine.parallel import StepOutput
from multilane.engine.run.metrics_window import MetricsWindow

NAMES = ["cpu:0", "cpu:1"]


def window_after(norms, losses, split=None):
    w = MetricsWindow(NAMES)
    w.resume()
    for k, (norm, loss) in enumerate(zip(norms, losses, strict=True)):
        if k == split:  # a stop here: the checkpoint carries the window, a new process loads it
            state = w.state_dict()
            w = MetricsWindow(NAMES)
            w.load_state_dict(state, torch.device("cpu"))
        lane = torch.tensor([loss, 2 * loss], dtype=torch.float32)
        w.add(StepOutput(lane.mean(), lane, [0, 1]), 8, k + 1)
        w.add_grad_norm(torch.tensor(norm, dtype=torch.float32))
        w.end_step()
    return w


def test_the_logged_norm_is_the_same_sum_whether_a_checkpoint_split_the_window_or_not():
    g = torch.Generator().manual_seed(0)
    norms = (torch.rand(10, generator=g) * 1e3).tolist()  # sums whose order shows in float32
    losses = torch.rand(10, generator=g).tolist()
    straight = window_after(norms, losses).record()
    assert straight is not None
    want = float(torch.tensor(norms, dtype=torch.float32).sum()) / 10
    assert abs(straight["grad_norm"] - want) <= 1e-6 * want
    for split in range(1, 10):
        got = window_after(norms, losses, split).record()
        assert got is not None
        assert got["grad_norm"] == straight["grad_norm"], split  # bit for bit
        assert got["loss"] == straight["loss"] and got["device_loss"] == straight["device_loss"]


def test_a_window_saved_before_the_norms_were_kept_one_by_one_still_loads():
    w = window_after([3.0, 5.0], [0.5, 0.25])
    state = w.state_dict()
    assert state["grad_norms"] is not None
    old = {k: v for k, v in state.items() if k != "grad_norms"}
    old["grad_norm_sum"] = torch.tensor(8.0)  # how it was written: the running sum
    resumed = MetricsWindow(NAMES)
    resumed.load_state_dict(old, torch.device("cpu"))
    resumed.add_grad_norm(torch.tensor(4.0))
    rec = resumed.record()
    assert rec is not None and rec["grad_norm"] == 12.0 / 3
