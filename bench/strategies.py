"""Step time of every way to train one model data-parallel, side by side in one run.

    python bench/strategies.py [--devices cpu:0,cpu:1] [--steps 40]
    python bench/strategies.py --devices cuda:0,cuda:1      # on a GPU machine (under 3 minutes)
    python bench/strategies.py --devices cuda:0,cuda:0      # two replicas on one GPU

For each model (an MLP with few modules, a ResNet-style network with many) and the same batch and
devices, it times:

- ``replicate``: Multilane's ReplicateEachStep (what nn.DataParallel does, plus a loss per device);
- ``persistent``: Multilane's PersistentReplicas (replicas kept, gradients summed across devices), with
  gradient buckets summed while backward runs (``overlap``, its default on GPUs) and after backward
  (``no overlap``, its default on CPU lanes);
- ``nn.DataParallel``: torch's own, the reference of the ratio column. On the CPU it cannot split
  (it runs the plain module on one device), which the table says;
- ``DDP``: torch's DistributedDataParallel, one process per device (NCCL on distinct GPUs, Gloo on
  the CPU; two processes cannot share one GPU under NCCL, so it is left out for ``cuda:0,cuda:0``).

The in-process loops take turns step by step in a shuffled order (load from elsewhere on a shared
machine lands on all alike; "replicate again" is a second, identical loop whose ratio to the first
shows the noise floor); DDP runs in its own processes after them. Each step ends with a device
sync on CUDA, so a step's time is the whole step.

A second table measures the choice PersistentReplicas makes after the optimizer: every replica steps
its own copy of the optimizer, or the first steps and the others copy its weights.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from multilane.engine.parallel import PersistentReplicas, chunk_sizes, make_backend, make_strategy
from multilane.engine.parallel.coalesced import copy_into
from multilane.engine.parallel.timing import PhaseTimer
from multilane.engine.telemetry.devices import parse_devices
from timing import interleaved
from torch import nn
from torch.nn import functional as F


# -- models ----------------------------------------------------------------------------------------
class Block(nn.Module):
    """A ResNet basic block: conv-BN-ReLU-conv-BN plus the identity."""

    def __init__(self, ch: int) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(ch, ch, 3, padding=1, bias=False), nn.BatchNorm2d(ch)
        self.c2, self.b2 = nn.Conv2d(ch, ch, 3, padding=1, bias=False), nn.BatchNorm2d(ch)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(x + self.b2(self.c2(self.relu(self.b1(self.c1(x))))))


def resnet(blocks: int, ch: int, classes: int = 10) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, ch, 3, padding=1, bias=False),
        nn.BatchNorm2d(ch),
        nn.ReLU(),
        *(Block(ch) for _ in range(blocks)),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(ch, classes),
    )


def mlp(features: int, width: int, depth: int, classes: int = 10) -> nn.Module:
    layers: list[nn.Module] = []
    for i in range(depth):
        layers += [nn.Linear(features if i == 0 else width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, classes))


def deep_narrow(depth: int, width: int, classes: int = 10) -> nn.Module:
    """Many small modules: the step is mostly per-module Python work, as on a GPU with a deep model."""
    return nn.Sequential(
        *(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)), nn.Linear(width, classes)
    )


# name -> (model builder, input shape per sample, batch), per device kind
CASES = {
    "cpu": {
        "mlp (4x512, 10 modules)": (lambda: mlp(256, 512, 4), (256,), 256),
        "resnet-style (32 blocks, ~200 modules)": (lambda: resnet(32, 8), (3, 8, 8), 32),
        "deep narrow MLP (300x16, ~900 modules)": (lambda: deep_narrow(300, 16), (16,), 64),
    },
    "cuda": {
        "mlp (4x2048, 10 modules)": (lambda: mlp(1024, 2048, 4), (1024,), 1024),
        "resnet-style (32 blocks, ~200 modules)": (lambda: resnet(32, 64), (3, 32, 32), 256),
        "deep narrow MLP (300x256, ~900 modules)": (lambda: deep_narrow(300, 256), (256,), 1024),
    },
}


def batch_for(shape: tuple[int, ...], batch: int, device: torch.device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, *shape, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    return x.to(device), y.to(device)


# -- the in-process loops ----------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def engine_loop(strategy_name: str, build: Callable[[], nn.Module], x, y, devices):
    """Multilane's step as the trainer runs it: forward_loss, backward, reduce, optimizer, sync."""
    backend = make_backend(devices)
    if strategy_name.startswith("persistent, "):
        strategy = PersistentReplicas(backend, overlap=strategy_name == "persistent, overlap")
    else:
        strategy = make_strategy(strategy_name, backend)
    torch.manual_seed(0)
    model = build().to(backend.model_device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    sizes = chunk_sizes(len(x), len(devices))
    timer = PhaseTimer()

    def step() -> None:
        out = strategy.forward_loss(model, x, y, F.cross_entropy, sizes, timer)
        opt.zero_grad(set_to_none=True)
        strategy.backward(out, out.loss)
        strategy.reduce_gradients(timer)
        opt.step()
        strategy.sync_replicas(model, timer)
        timer.end_step()
        sync(backend.model_device)

    def close() -> None:
        strategy.close()
        backend.close()

    return step, close


def data_parallel_loop(build: Callable[[], nn.Module], x, y, devices):
    """torch's nn.DataParallel; on the CPU its single-device path (it cannot split there)."""
    dev = devices[0].torch_device()
    torch.manual_seed(0)
    model = build().to(dev)
    ids = [d.index for d in devices] if dev.type == "cuda" else None
    dp = nn.DataParallel(model, device_ids=ids)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step() -> None:
        loss = F.cross_entropy(dp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sync(dev)

    return step, lambda: None


# -- keeping replicas equal: every device steps its own, or one steps and the others copy ---------------
def optimizer_choice(build: Callable[[], nn.Module], devices, steps: int) -> dict[str, float]:
    """Median time of (a) an Adam step on every replica, (b) one Adam step and a copy into the others."""
    models = []
    for d in devices:
        torch.manual_seed(0)
        m = build().to(d.torch_device())
        for p in m.parameters():
            p.grad = torch.randn_like(p)
        models.append(m)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-3) for m in models]
    params = [list(m.parameters()) for m in models]
    first = devices[0].torch_device()

    def each() -> None:
        for o in opts:
            o.step()
        sync(first)

    def one_and_copy() -> None:
        opts[0].step()
        with torch.no_grad():
            copy_into(params[1:], params[0])
        sync(first)

    fns = {"each": each, "copy": one_and_copy}
    for fn in fns.values():
        fn()
    return interleaved(fns, steps)


# -- DDP in its own processes ------------------------------------------------------------------------
def _ddp_worker(
    rank: int, world: int, case_kind: str, case: str, devices: list[str], steps: int, port: int, threads: int, q
) -> None:
    dev = torch.device(devices[rank])
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    else:
        torch.set_num_threads(threads)
        torch.set_flush_denormal(True)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    build, shape, batch = CASES[case_kind][case]
    torch.manual_seed(0)
    model = build().to(dev)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    sizes = chunk_sizes(batch, world)
    x, y = batch_for(shape, batch, torch.device("cpu"))
    start = sum(sizes[:rank])
    x, y = x[start : start + sizes[rank]].to(dev), y[start : start + sizes[rank]].to(dev)
    times = []
    for i in range(steps + 5):
        dist.barrier()
        t0 = time.perf_counter()
        loss = F.cross_entropy(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sync(dev)
        if i >= 5:
            times.append(time.perf_counter() - t0)
    # A step is over when the slowest rank is done.
    t = torch.tensor(times)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if rank == 0:
        q.put(statistics.median(t.tolist()))
    dist.destroy_process_group()


def ddp_time(case_kind: str, case: str, devices: list[str], steps: int, port: int, threads: int) -> float | str:
    if devices[0].startswith("cuda") and len(set(devices)) < len(devices):
        return "n/a: NCCL needs one GPU per process"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    mp.spawn(_ddp_worker, args=(len(devices), case_kind, case, devices, steps, port, threads, q), nprocs=len(devices))
    return q.get(timeout=60)


# -- main ------------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--devices", default="cpu:0,cpu:1", help="cpu:0,cpu:1 (CPU lanes), cuda:0,cuda:1, cuda:0,cuda:0")
    ap.add_argument("--steps", type=int, default=40, help="timed steps of each loop (after 5 warm-up steps)")
    ap.add_argument("--no-ddp", action="store_true", help="leave DDP out")
    ap.add_argument("--port", type=int, default=29533, help="DDP's rendezvous port on 127.0.0.1")
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="CPU: torch intra-op threads for every loop and every DDP process (default: cores / devices)",
    )
    args = ap.parse_args()
    torch.set_flush_denormal(True)
    devices = parse_devices(args.devices)
    if not devices[0].is_cuda:
        # Every lane is a thread that runs torch ops with their own intra-op threads: lanes x threads
        # beyond the cores makes OpenMP's spinning workers fight (measured 10x slower on a loaded
        # 2-core machine). One budget for all: each lane, and each DDP process, gets cores / devices.
        args.threads = args.threads or max(1, (os.cpu_count() or 1) // len(devices))
        torch.set_num_threads(args.threads)
    names = [str(d.torch_device()) if d.is_cuda else f"cpu:{i}" for i, d in enumerate(devices)]
    kind = "cuda" if devices[0].is_cuda else "cpu"
    first = devices[0].torch_device()
    print(
        f"torch {torch.__version__}, devices {args.devices}, {torch.get_num_threads()} intra-op threads, "
        f"median of {args.steps} interleaved steps (SGD with momentum, cross-entropy)"
    )
    print(f"load average at start: {os.getloadavg()[0]:.1f} ({os.cpu_count()} cores)")
    if kind == "cpu":
        print("nn.DataParallel cannot split on the CPU: its row is the plain model on one device (*).")
    print()
    print(f"{'model':40} {'strategy':26} {'step ms':>9} {'samples/s':>10} {'vs DataParallel':>16}")
    for port_offset, (case, (build, shape, batch)) in enumerate(CASES[kind].items()):
        x, y = batch_for(shape, batch, first)
        makers = {
            "nn.DataParallel" + (" (*)" if kind == "cpu" else ""): (data_parallel_loop, ()),
            "replicate": (engine_loop, ("replicate",)),
            "replicate again (A/A)": (engine_loop, ("replicate",)),
            "persistent, overlap": (engine_loop, ("persistent, overlap",)),
            "persistent, no overlap": (engine_loop, ("persistent, no overlap",)),
        }
        # A loop that cannot run on these devices gets a row saying why; the others are still timed.
        failed: dict[str, str] = {}
        loops = {}
        for k, (make, name) in makers.items():
            try:
                loops[k] = make(*name, build, x, y, devices)
                for _ in range(5):
                    loops[k][0]()
            except Exception as e:
                failed[k] = f"n/a: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
                loops.pop(k, None)
        fns = {k: step for k, (step, _) in loops.items()}
        timed = interleaved(fns, args.steps)
        times: dict[str, float | str] = {k: failed.get(k) or timed[k] for k in makers}
        for _, close in loops.values():
            close()
        if not args.no_ddp:
            proc = "Gloo" if kind == "cpu" else "NCCL"
            try:
                times[f"DDP ({proc}, {len(devices)} processes)"] = ddp_time(
                    kind, case, names, args.steps, args.port + port_offset, args.threads
                )
            except Exception as e:
                times[f"DDP ({proc}, {len(devices)} processes)"] = f"n/a: {type(e).__name__}: {e}"[:100]
        ref = next(iter(times.values()))
        if not isinstance(ref, float):  # no DataParallel row to compare with: compare with replicate
            ref = times["replicate"]
            assert isinstance(ref, float), times
        for i, (k, t) in enumerate(times.items()):
            label = case if i == 0 else ""
            if isinstance(t, str):
                print(f"{label:40} {k:26} {t}")
                continue
            print(f"{label:40} {k:26} {t * 1000:9.2f} {batch / t:10,.0f} {ref / t:15.2f}x")
        sys.stdout.flush()
    print("\nKeeping the replicas equal after the optimizer (Adam), median ms:")
    print(f"{'model':40} {'every replica steps':>20} {'one steps + copy':>17} {'ratio':>6}")
    for case, (build, _shape, _batch) in CASES[kind].items():
        t = optimizer_choice(build, devices, args.steps)
        print(f"{case:40} {t['each'] * 1000:20.2f} {t['copy'] * 1000:17.2f} {t['each'] / t['copy']:6.2f}")


if __name__ == "__main__":
    main()
