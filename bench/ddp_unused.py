"""What ``find_unused_parameters`` costs a ddp step, and what the engine's way pays instead.

    python bench/ddp_unused.py [--steps 60] [--ranks 2]

DDP with ``find_unused_parameters=True`` walks the autograd graph after every forward and all-reduces
a map of the parameters used. The ddp strategy (engine/distributed/ddp.py) keeps it only when the
first step shows a parameter some rank's backward did not reach; otherwise it rebuilds DDP without it
after step 1 (a one-time graph walk, an all-reduce and DDP's construction). This bench times, on
Gloo ranks on 127.0.0.1 (CPU), the same model under both DDPs, step by step in turns (each rank holds
two copies of the model, one per DDP, so a busy machine slows both alike), and the one-time switch.
Table: median step time with and without, their ratio, and the switch's cost.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

MODELS = {
    "mlp 4 x 256 (8 tensors)": lambda: nn.Sequential(
        *[nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(4)]
    ),
    "mlp 64 x 64 (128 tensors)": lambda: nn.Sequential(
        *[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(64)]
    ),
    "mlp 256 x 32 (512 tensors)": lambda: nn.Sequential(
        *[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(256)]
    ),
}


def _rank(rank: int, world: int, port: int, steps: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from multilane.engine.distributed.rank_state import reached

    rows = []
    for name, make in MODELS.items():
        torch.manual_seed(0)
        base = make()
        width = base[0][0].in_features
        plain = DistributedDataParallel(make(), find_unused_parameters=False)
        walk = DistributedDataParallel(make(), find_unused_parameters=True)
        x = torch.randn(64, width)
        times: dict[str, list[float]] = {"without": [], "with": []}
        for step in range(steps):
            for label, ddp in (
                (("without", plain), ("with", walk)) if step % 2 else (("with", walk), ("without", plain))
            ):
                t0 = time.perf_counter()
                ddp(x).square().mean().backward()
                times[label].append(time.perf_counter() - t0)
        # The engine's one-time switch: walk the graph of step 1, agree, rebuild DDP without the walk.
        model = make()
        t0 = time.perf_counter()
        ddp = DistributedDataParallel(model, find_unused_parameters=True)
        loss = ddp(x).square().mean()
        t1 = time.perf_counter()
        seen = reached(loss)
        used = all(id(p) in seen for p in model.parameters())
        flag = torch.tensor([int(used)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        del ddp
        DistributedDataParallel(model, find_unused_parameters=False)
        switch = (t2 - t1) + (time.perf_counter() - t3)
        warm = steps // 5
        rows.append(
            (
                name,
                statistics.median(times["without"][warm:]),
                statistics.median(times["with"][warm:]),
                switch,
            )
        )
    if rank == 0:
        out["rows"] = rows
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--ranks", type=int, default=2)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    manager = mp.Manager()
    out = manager.dict()
    mp.spawn(_rank, args=(args.ranks, port, args.steps, out), nprocs=args.ranks)
    print(f"{args.ranks} Gloo ranks on 127.0.0.1, batch 64 per rank, forward + backward (all-reduce), median ms")
    print("| model | without find_unused | with find_unused | ratio | engine's one-time switch |")
    print("| --- | --- | --- | --- | --- |")
    for name, without, with_, switch in out["rows"]:
        print(f"| {name} | {without * 1e3:.2f} | {with_ * 1e3:.2f} | {with_ / without:.2f} | {switch * 1e3:.1f} ms |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
