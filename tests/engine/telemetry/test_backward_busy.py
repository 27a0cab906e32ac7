"""A lane's share of replicate's one backward counts as its busy time: autograd walks every
lane's graph in the calling thread, their nodes interleaved, and each lane is credited with the time its
own nodes take, measured node by node on the first three backwards and one in ten (the others split at the median share)
— real torch on CPU lanes, no share assumed from batch sizes."""

import statistics
import time

import pytest
import torch
from multilane.engine.parallel.backend import make_backend
from multilane.engine.parallel.strategies import make_strategy
from multilane.engine.parallel.timing import PhaseTimer
from multilane.engine.telemetry.busy import BusyClock, graph_owners, lane_backward, median_shares
from multilane.engine.telemetry.devices import parse_devices
from torch import nn


def mlp(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 384), nn.ReLU(), nn.Dropout(dropout), nn.Linear(384, 384), nn.ReLU(), nn.Linear(384, 10)
    )


def backward_shares(strategy: str, model: nn.Module, sizes: list[int], steps: int = 25) -> list[tuple]:
    """Per step: the backward's wall seconds and what each lane was credited during it."""
    backend = make_backend(parse_devices("cpu:0,cpu:1"))
    s = make_strategy(strategy, backend)
    x, y = torch.randn(sum(sizes), 64), torch.randint(0, 10, (sum(sizes),))
    rows = []
    try:
        for k in range(steps):
            measured = backend.backward_shares.measured
            out = s.forward_loss(model, x, y, nn.functional.cross_entropy, sizes, PhaseTimer())
            before, t0 = backend.lane_busy_seconds(), time.perf_counter()
            s.backward(out, out.loss)
            wall, after = time.perf_counter() - t0, backend.lane_busy_seconds()
            time.sleep(0.002)
            assert backend.lane_busy_seconds() == after  # no lane left running after the backward
            s.reduce_gradients(PhaseTimer())
            s.sync_replicas(model, PhaseTimer())
            model.zero_grad()
            rows.append((wall, *(b - a for a, b in zip(before, after, strict=True))))
            if k >= 5 and backend.backward_shares.measured == measured:  # split at the shares measured
                shares = backend.backward_shares.shares[(0, 1)]
                for lane, credit in enumerate(rows[-1][1:]):
                    assert 0.8 * shares[lane] * wall <= credit <= shares[lane] * wall, (shares, wall, credit)
    finally:
        backend.close()
    # node by node on the first three backwards and one in ten: the hooks cost ~10 µs a node
    assert backend.backward_shares.measured == sum(k < 3 or k % 10 == 0 for k in range(steps))
    return rows[5:]  # the first steps warm the allocator up


@pytest.mark.parametrize(
    "strategy, dropout",
    [("replicate", 0.0), ("persistent", 0.2)],  # persistent with dropout: its one backward over every lane
)
def test_each_lane_is_credited_with_its_own_part_of_the_one_backward(strategy, dropout):
    rows = backward_shares(strategy, mlp(dropout), [192, 64])
    for wall, lane0, lane1 in rows:
        # one thread ran it: the lanes' credit never adds up to more than the backward took
        assert lane0 + lane1 <= wall * 1.001 + 1e-5, (wall, lane0, lane1)
    wall, lane0, lane1 = (statistics.median(c) for c in zip(*rows, strict=True))
    # much of a backward is the lanes' own graphs (before: none of it was counted, 0 s for both; a
    # quiet machine gives them 80 %, one loaded by other jobs a third at times)
    assert lane0 > 0 and lane1 > 0 and lane0 + lane1 >= 0.25 * wall, (wall, lane0, lane1)
    assert lane0 > 1.3 * lane1, (lane0, lane1)  # three times the rows: measured more work, not an equal share


def test_one_preempted_measure_does_not_move_the_shares_a_lane_is_credited_at():
    """A measure in which the thread waited inside lane 1's node (0.9 of the backward) among four that
    agree: the lanes are credited at the median, not at the last measure; medians that add up to more
    than the backward (from different backwards) are scaled to its wall time."""
    history = [[0.6, 0.2], [0.62, 0.21], [0.58, 0.19], [0.61, 0.2], [0.05, 0.9]]
    assert median_shares(history) == [0.6, 0.2]
    assert median_shares([[0.7, 0.2], [0.2, 0.7], [0.7, 0.7]]) == pytest.approx([0.5, 0.5])


def test_graph_owners_splits_the_nodes_by_lane_and_leaves_the_sum_to_no_lane():
    w = nn.Parameter(torch.ones(3))
    copies = torch.stack([w, w]).unbind(0)  # stands for LaneCopies: one node every lane's graph reaches
    losses = [(copies[i] * (i + 2.0)).sum() for i in range(2)]
    total = losses[0] + losses[1]
    stop = lambda node: type(node).__name__ == "StackBackward0"  # noqa: E731
    owner = graph_owners(total.grad_fn, [(0, losses[0].grad_fn), (1, losses[1].grad_fn)], stop)
    assert owner[total.grad_fn] is None  # the combination: no lane's
    assert owner[losses[0].grad_fn] == 0 and owner[losses[1].grad_fn] == 1
    stack = next(n for n in owner if stop(n))
    assert owner[stack] is None
    # a hooked backward through them credits the lanes, and the hooks leave with the block
    clock = BusyClock(2)
    with lane_backward(clock, total.grad_fn, [(0, losses[0].grad_fn), (1, losses[1].grad_fn)], stop):
        total.backward(retain_graph=True)
    credited = clock.seconds()
    assert all(s > 0 for s in credited)
    total.backward()  # the same graph again, outside the block: nothing more is credited
    assert clock.seconds() == credited
