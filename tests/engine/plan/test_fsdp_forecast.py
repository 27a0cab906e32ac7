"""Will it fit under fsdp: FSDP2's shard rule against what a real
``fully_shard`` holds on each rank of a 2-rank Gloo group, ``plan --strategy fsdp`` against replicate for a
model whose state dominates, the refusal before an fsdp run that will not fit, and an fsdp run's
per-rank peak beside its forecast. The forecast's accuracy on three models: bench/memory_forecast.py
(docs/performance.md, "Will it fit")."""

from __future__ import annotations

import json
import os
import socket
import subprocess

import pytest
import torch
import torch.multiprocessing as mp
from helpers import CLI
from multilane.engine.cli.main import main
from multilane.engine.plan import measure
from multilane.engine.plan.forecast import small_difference
from multilane.engine.plan.meter import memory_lines
from multilane.engine.plan.shards import rows, shard_bytes
from torch import nn


@pytest.fixture(autouse=True)
def _fit_check_on(monkeypatch):
    monkeypatch.setenv("MULTILANE_FIT_CHECK", "1")


def test_the_rule_splits_dim_0_as_torch_chunk_padded_to_the_first_piece():
    for dim0 in range(0, 10):
        for n in range(1, 5):
            pieces = [c.shape[0] for c in torch.chunk(torch.empty(dim0), n)] if dim0 else []
            pieces += [0] * (n - len(pieces))  # FSDP2 gives the ranks past the last piece an empty one
            assert [rows(dim0, n, r)[1] for r in range(n)] == pieces
            assert all(rows(dim0, n, r)[0] == (pieces[0] if dim0 else 0) for r in range(n))


def test_the_cpu_measure_follows_a_storage_resized_in_place_and_the_tensors_inside_a_dtensor():
    count = measure.StorageCount()
    count.baseline()
    with measure.CpuCounting(count, None):
        a = torch.ones(1000)  # 4,000 bytes
        a.untyped_storage().resize_(0)  # as FSDP frees a gathered parameter: no op sees it
        count.reset_peak()  # a phase's start re-reads every size: 0, and watched from now on
        assert count.current == 0
        a.untyped_storage().resize_(4000)
        b = torch.zeros(10)  # any op: the watched storage's size is re-read
        assert count.current == 4040 and count.peak == 4040
        del a, b
    # Found empty when counting starts (a meter's add_live between FSDP's steps): watched at once.
    later = measure.StorageCount()
    c = torch.ones(100)
    c.untyped_storage().resize_(0)
    later.add_live()  # every tensor alive in this process: c's storage at 0 bytes among them
    before = later.current
    with measure.CpuCounting(later, None):
        c.untyped_storage().resize_(400)
        d = torch.zeros(1)
        assert later.current == before + 404
        del c, d


def test_a_tiny_peak_is_compared_in_bytes_a_large_one_in_percent():
    assert small_difference(3_789, 30_413) == "-26.0 KiB"
    assert small_difference(600_000, 500_000) == "+97.7 KiB"
    assert small_difference(3 << 20, 2 << 20) is None
    rows = {"cpu": {"forecast": 3_789, "measured": 30_413}, "cuda:0": {"forecast": 3 << 30, "measured": 3 << 30}}
    assert memory_lines(rows) == [
        "peak tensor memory cpu: 29.7 KiB measured, 3.7 KiB forecast (-26.0 KiB)",
        "peak tensor memory cuda:0: 3.00 GiB measured, 3.00 GiB forecast (+0.0 %)",
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(dtype: torch.dtype) -> nn.Module:
    """Dims that do not split evenly over 2: 5 rows (3 + 2), 1 row (1 + an empty piece), a conv, an embedding."""
    return nn.Sequential(
        nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 1), nn.Conv1d(3, 5, 3), nn.Embedding(3, 4)
    ).to(dtype)  # fmt: skip


def _rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from multilane.engine.fsdp.units import default_units, shard_model
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    found = {}
    for dtype, opt_name in ((torch.float64, "adamw"), (torch.float32, "sgd")):
        torch.manual_seed(0)
        m = _model(dtype)
        rule = shard_bytes(list(m.parameters()), 2, rank, opt_name, momentum=0.9)
        shard_model(m, default_units(m), "fp32", init_device_mesh("cpu", (2,)))
        opt = torch.optim.AdamW(m.parameters()) if opt_name == "adamw" else torch.optim.SGD(m.parameters(), 0.1, 0.9)
        x = torch.randn(4, 7, dtype=dtype)
        y = m[2](m[1](m[0](x))).sum() + m[3](torch.randn(2, 3, 6, dtype=dtype)).sum() + m[4](torch.tensor([0, 2])).sum()
        y.backward()
        opt.step()

        def held(ts: list[torch.Tensor]) -> int:  # each storage once, at its size (padding included)
            return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in ts}.values())

        local = [p.to_local() for p in m.parameters()]
        grads = [p.grad.to_local() for p in m.parameters()]
        state = [v.to_local() if hasattr(v, "to_local") else v for s in opt.state.values() for v in s.values()]
        found[str(dtype)] = [[held(local), held(grads), held(state)], [rule.params, rule.grads, rule.optimizer]]
    with open(f"{out}.{rank}", "w") as f:
        json.dump(found, f)
    dist.destroy_process_group()


@pytest.mark.slow
def test_the_shard_rule_equals_what_a_real_fully_shard_holds_on_each_of_2_ranks(tmp_path):
    mp.spawn(_rank, (_free_port(), str(tmp_path / "held")), nprocs=2)
    for rank in (0, 1):
        found = json.loads((tmp_path / f"held.{rank}").read_text())
        for dtype in ("torch.float64", "torch.float32"):
            held, rule = found[dtype]
            assert held == rule, (rank, dtype)
    # Rank 0 holds the first (padded) pieces: more optimizer state than rank 1; the same padded parameters.
    r0, r1 = (json.loads((tmp_path / f"held.{r}").read_text())["torch.float64"][0] for r in (0, 1))
    assert r0[0] == r1[0] and r0[2] > r1[2] > 0


@pytest.mark.slow
def test_plan_under_fsdp_needs_less_per_device_than_replicate_when_the_state_dominates(capsys):
    # 4 layers of 1,024: 3.2 M parameters, 50 MB with their gradients and Adam's two moments; batch 8.
    base = ["plan", "--task", "mlp", "--devices", "cpu:0,cpu:1", "--batch-size", "8"]
    base += ["--set", "task.params.width=1024", "--set", "task.params.depth=4"]
    assert main([*base, "--strategy", "replicate", "--json"]) == 0
    replicate = json.loads(capsys.readouterr().out.splitlines()[-1])["needs"][0]
    assert main([*base, "--strategy", "fsdp"]) == 0
    text = capsys.readouterr().out
    assert "memory forecast for batch 8 (fsdp, 2 device(s)):" in text and "2 processes, each up to" in text
    assert main([*base, "--strategy", "fsdp", "--json"]) == 0
    fsdp = json.loads(capsys.readouterr().out.splitlines()[-1])["needs"][0]
    shards, whole = fsdp["shards"]
    assert abs(shards - whole / 2) <= 0.001 * whole  # half of one device's, to the padding
    assert shards < fsdp["per_rank"] < 0.75 * replicate["need"], (fsdp, replicate)  # shards + gathered units


def test_plan_under_fsdp_in_its_own_process_holds_rank_0s_padded_shards_and_counts_both_ranks():
    """The fast tier's run of the fsdp probe (probe.py, an fsdp rank's own step): ``plan --strategy fsdp`` as the user runs it, in a
    process of its own (the probe's fake process group leaves a thread behind in the process). The shards
    are FSDP2's rule, counted here by hand: rank 0 holds ceil(rows / 2) rows of every parameter and of its
    gradient and Adam's two moments, and one 4-byte step counter per parameter; the 2 CPU ranks share one
    RAM, so it needs both ranks' peaks; each rank's peak holds its shards and more (gathered units,
    activations), and grows with the batch."""
    from multilane.engine.tasks import make_task

    r = subprocess.run(
        [*CLI, "plan", "--task", "mlp", "--devices", "cpu:0,cpu:1", "--strategy", "fsdp", "--batch-size", "8",
         "--set", "task.params.width=255", "--set", "task.params.features=7", "--json"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "MULTILANE_FIT_CHECK": "1"},
    )  # fmt: skip
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    plan = json.loads(r.stdout.splitlines()[-1])
    assert (plan["strategy"], plan["n_devices"], plan["batch"]) == ("fsdp", 2, 8)
    params = list(make_task("mlp", {"width": 255, "features": 7}).build_model().parameters())
    rank0 = sum(4 * 4 * -(-p.shape[0] // 2) * (p.numel() // p.shape[0]) + 4 for p in params)
    whole = sum(4 * 4 * p.numel() + 4 for p in params)
    (need,) = plan["needs"]
    assert need["shards"] == [rank0, whole] and rank0 > whole / 2  # 255 rows: rank 0 holds 128 of them
    assert need["ranks"] == 2 and need["need"] == 2 * need["per_rank"] and need["per_rank"] > rank0
    (line,) = plan["lines"]
    forward = [peak for _, peak in sorted(line["phases"]["forward"])]
    assert len(forward) >= 2 and forward == sorted(forward), forward


@pytest.mark.slow
def test_an_fsdp_run_that_will_not_fit_gets_one_line_naming_the_largest_batch_and_starts_nothing(tmp_path):
    # 64 hidden layers of 64: ~32 kB of activations a sample; 1,000,000 samples do not fit this machine.
    params = ["--set", "task.params.features=1", "--set", "task.params.width=64", "--set", "task.params.depth=64"]
    params += ["--set", "task.params.samples=1000000", "--set", "data.val_fraction=0"]
    runs = tmp_path / "runs"
    r = subprocess.run(
        [*CLI, "train", "--task", "mlp", "--devices", "cpu:0,cpu:1", "--strategy", "fsdp", "--batch-size",
         "1000000", "--steps", "2", "--runs-dir", str(runs), *params],
        capture_output=True, text=True, timeout=600, env={**os.environ, "MULTILANE_FIT_CHECK": "1"},
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    lines = [x for x in r.stderr.splitlines() if "USDT" not in x]
    assert len(lines) == 1 and lines[0].startswith("multilane: error: will not fit: the CPU lanes need"), lines
    largest = int(lines[0].rsplit("--batch-size ", 1)[1])
    assert 0 < largest < 1_000_000
    assert f"the largest batch that fits is {largest:,} ({largest // 2:,} per device)" in lines[0]
    assert not runs.exists() or not any(runs.iterdir())  # no rank started, no run folder


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_a_process_run_sets_each_ranks_measured_peak_beside_its_forecast(tmp_path, strategy):
    """Each rank's measured peak within 10 % of its forecast. A ddp process's first 4 steps find what each
    backward reaches under ``no_sync`` (DDP's buckets idle, 10.6 % below the steps after them on this MLP):
    the probe lets them pass before it measures, and so does the rank's meter, so the ddp run takes 6 steps."""
    runs = tmp_path / "runs"
    steps = "6" if strategy == "ddp" else "3"
    r = subprocess.run(
        [*CLI, "train", "--task", "mlp", "--devices", "cpu:0,cpu:1", "--strategy", strategy, "--batch-size", "256",
         "--steps", steps, "--runs-dir", str(runs), "--set", "train.log_every=1", "--set", "train.eval_every=0"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "MULTILANE_FIT_CHECK": "1"},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "peak tensor memory rank 0:" in r.stdout and "peak tensor memory rank 1:" in r.stdout, r.stdout
    (run,) = runs.iterdir()
    events = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    peaks = next(e["peaks"] for e in events if e.get("event") == "memory")
    assert set(peaks) == {"rank 0", "rank 1"}
    for row in peaks.values():
        assert abs(row["forecast"] - row["measured"]) <= 0.10 * row["measured"], peaks


@pytest.mark.slow
def test_an_fsdp_run_whose_setup_is_its_peak_measures_the_setup_too(tmp_path):
    # 4 ranks, plain SGD, a small batch: each rank's steps hold a quarter of the parameters and gradients,
    # its setup the whole model and the first shards. The forecast's need is the setup's; the measured
    # peak must count it too, or the summary reads as a forecast far too high.
    args = ["--task", "mlp", "--devices", "cpu:0,cpu:1,cpu:2,cpu:3", "--strategy", "fsdp", "--batch-size", "8"]
    args += ["--set", "task.params.width=256", "--set", "task.params.features=256", "--set", "task.params.depth=16"]
    args += ["--set", "optim.name=sgd", "--set", "optim.momentum=0", "--set", "health.enabled=false"]
    env = {**os.environ, "MULTILANE_FIT_CHECK": "1"}
    plan = subprocess.run([*CLI, "plan", *args, "--json"], capture_output=True, text=True, timeout=300, env=env)
    assert plan.returncode == 0, plan.stderr
    phases = json.loads(plan.stdout.splitlines()[-1])["lines"][0]["phases"]
    setup = max(v for _, v in phases["setup"])
    steps = max(v for p in ("forward", "backward", "optimizer") for _, v in phases[p])
    assert setup > 1.2 * steps, phases  # the setup is this run's peak, by a margin
    runs = tmp_path / "runs"
    r = subprocess.run(
        [*CLI, "train", *args, "--steps", "3", "--runs-dir", str(runs), "--set", "train.eval_every=0"],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    (run,) = runs.iterdir()
    events = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    peaks = next(e["peaks"] for e in events if e.get("event") == "memory")
    assert set(peaks) == {f"rank {k}" for k in range(4)}
    for row in peaks.values():
        assert abs(row["forecast"] - row["measured"]) <= 0.10 * row["measured"], peaks
