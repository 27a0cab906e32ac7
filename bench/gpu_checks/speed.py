"""Speed: each strategy's step against torch's nn.DataParallel and DDP, on the same model, batch and devices.

Models: an MLP sized to keep the GPU busy (bf16 autocast: its step's TFLOP/s against the card's bf16
rate) and a ResNet-style network with many modules. Devices: one GPU, and two replicas on it. The
in-process loops take turns step by step (noise lands on all alike); every step ends with a device
sync, so a step's time is the whole step; the median after warm-up. DDP runs in two processes on the
one GPU: NCCL where it accepts two ranks on one device, Gloo otherwise (the row says which ran).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import INFO, PASS, SKIP, Context, Row
from environment import bf16_peak
from timing import interleaved
from torch import nn
from torch.nn import functional as F


def mlp(features: int, width: int, depth: int, classes: int = 16) -> nn.Module:
    layers: list[nn.Module] = []
    for i in range(depth):
        layers += [nn.Linear(features if i == 0 else width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, classes))


class Block(nn.Module):
    def __init__(self, ch: int) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(ch, ch, 3, padding=1, bias=False), nn.BatchNorm2d(ch)
        self.c2, self.b2 = nn.Conv2d(ch, ch, 3, padding=1, bias=False), nn.BatchNorm2d(ch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.b2(self.c2(F.relu(self.b1(self.c1(x))))))


def resnet(blocks: int, ch: int, classes: int = 16) -> nn.Module:
    head = [nn.Conv2d(3, ch, 3, padding=1, bias=False), nn.BatchNorm2d(ch), nn.ReLU()]
    return nn.Sequential(
        *head, *(Block(ch) for _ in range(blocks)), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(ch, classes)
    )


def linear_flops(model: nn.Module, batch: int) -> float:
    """FLOPs of one training step of the model's Linear layers: 2 per multiply-add forward, 4 backward."""
    return 6.0 * batch * sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, nn.Linear))


# name -> (builder, input shape of a sample, batch), per mode
MODELS = {
    "gpu": {
        "mlp 4x8192": (lambda: mlp(8192, 8192, 4), (8192,), 8192),
        "resnet-style 32 blocks": (lambda: resnet(32, 64), (3, 32, 32), 256),
    },
    "dry": {
        "mlp 4x256": (lambda: mlp(256, 256, 4), (256,), 256),
        "resnet-style 4 blocks": (lambda: resnet(4, 8), (3, 8, 8), 32),
    },
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def data_for(shape: tuple[int, ...], batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch, *shape, generator=g).to(device), torch.randint(0, 16, (batch,), generator=g).to(device)


def plain_loop(build: Callable[[], nn.Module], x: torch.Tensor, y: torch.Tensor, autocast: bool):
    model = build().to(x.device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def step() -> None:
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = F.cross_entropy(model(x).float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sync(x.device)

    return step


def data_parallel(build: Callable[[], nn.Module], x: torch.Tensor, y: torch.Tensor, autocast: bool, lanes: int):
    """torch's nn.DataParallel (on the CPU it cannot split: the plain module on one device)."""
    model = build().to(x.device)
    ids = [x.device.index or 0] * lanes if x.device.type == "cuda" else None
    dp = nn.DataParallel(model, device_ids=ids)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def step() -> None:
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = F.cross_entropy(dp(x).float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sync(x.device)

    return step


def engine(strategy_name: str, devices: str, build: Callable[[], nn.Module], x, y, autocast: bool):
    """The engine's step as its trainer runs it: forward_loss, backward, reduce, optimizer, sync."""
    from multilane.engine.parallel import chunk_sizes, make_backend, make_strategy
    from multilane.engine.telemetry.devices import parse_devices

    devs = parse_devices(devices)
    backend = make_backend(devs)
    strategy = make_strategy(strategy_name, backend, "bf16" if autocast else "fp32")
    model = build().to(backend.model_device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    sizes = chunk_sizes(len(x), len(devs))
    timer = backend.make_timer()

    def loss_fn(out, target):
        return F.cross_entropy(out.float(), target)

    def step() -> None:
        out = strategy.forward_loss(model, x, y, loss_fn, sizes, timer)
        opt.zero_grad(set_to_none=True)
        strategy.backward(out, out.loss)
        strategy.reduce_gradients(timer)
        opt.step()
        strategy.sync_replicas(model, timer)
        timer.end_step()
        sync(backend.model_device)

    return step, lambda: (strategy.close(), backend.close())


def _ddp_rank(
    rank: int, device: str, backend: str, port: int, model: str, mode: str, steps: int, q, kind: str = "ddp"
) -> None:
    """One rank of torch's DDP (``kind`` "ddp") or FSDP2 (``kind`` "fsdp": ``fully_shard`` on each layer
    with parameters, then the root, as the engine's default units): its half of the batch, the same
    model and optimizer as the in-process loops."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        build, shape, batch = MODELS[mode][model]
        torch.manual_seed(0)
        net = build().to(dev)
        if kind == "fsdp":
            from torch.distributed.fsdp import fully_shard

            for layer in [
                m for m in net.modules() if m is not net and next(m.parameters(recurse=False), None) is not None
            ]:
                fully_shard(layer)
            ddp = fully_shard(net)
        else:
            ddp = nn.parallel.DistributedDataParallel(net, device_ids=[dev.index] if dev.type == "cuda" else None)
        opt = torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9)
        x, y = data_for(shape, batch, dev)
        x, y = x.chunk(2)[rank], y.chunk(2)[rank]
        times = []
        for i in range(steps + 3):
            dist.barrier()
            t0 = time.perf_counter()
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=model.startswith("mlp") and mode == "gpu"):
                loss = F.cross_entropy(ddp(x).float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sync(dev)
            if i >= 3:
                times.append(time.perf_counter() - t0)
        t = torch.tensor(times)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step ends when the slower rank is done
        if rank == 0:
            q.put(statistics.median(t.tolist()))
    finally:
        dist.destroy_process_group()


def ddp_time(
    ctx: Context, model: str, backend: str, steps: int, deadline_s: float = 120, kind: str = "ddp"
) -> float | str:
    """Median step of torch's DDP (or FSDP2: ``kind``) in two processes on ``ctx.two``'s devices, or why
    it did not run."""
    from multilane.engine.distributed.launcher import free_port

    mode = "dry" if ctx.dry_run else "gpu"
    devices = ctx.two.split(",")
    mpc = mp.get_context("spawn")
    q = mpc.Queue()
    port = free_port()
    procs = [
        mpc.Process(target=_ddp_rank, args=(r, devices[r], backend, port, model, mode, steps, q, kind))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + deadline_s
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    if not q.empty():
        return q.get()
    codes = [p.exitcode for p in procs]
    return f"failed (exit codes {codes}; killed after {deadline_s:.0f} s where None)"


def run(ctx: Context) -> None:
    mode = "dry" if ctx.dry_run else "gpu"
    peak = None if ctx.dry_run else bf16_peak(torch.cuda.get_device_name(0))
    ceiling = None if ctx.dry_run else matmul_tflops()
    if ceiling is not None:
        ctx.add(Row("speed", "bf16 matmul 8192^3 (ceiling)", f"{ceiling:.0f} TFLOP/s", f"datasheet {peak}", INFO))
    if ctx.dry_run:
        torch.set_num_threads(1)  # one core's worth per lane: lanes x threads beyond the cores fight
    for model, (build, _, batch) in MODELS[mode].items():
        flops = linear_flops(build(), batch) if model.startswith("mlp") else None
        for devices in ctx.device_lists():
            timed = time_loops(ctx, model, devices)
            if devices == ctx.two and not (ctx.dry_run and model != next(iter(MODELS[mode]))):  # dry run: one DDP
                timed.update(ddp_rows(ctx, model))
            ref = next(
                (timed[k] for k in ("nn.DataParallel", "plain loop", "replicate") if isinstance(timed.get(k), float)),
                None,
            )
            for name, t in timed.items():
                add_row(ctx, f"{model} [{devices}] {name}", t, ref, batch, flops, peak, ceiling)
    if ctx.dry_run:
        ctx.add(Row("speed", "TFLOP/s against the card's bf16 peak", "-", "GPU only", SKIP))


def time_loops(ctx: Context, model: str, devices: str) -> dict[str, float | str]:
    """Median step time of each in-process loop, or why a loop could not run (the others still run)."""
    build, shape, batch = MODELS["dry" if ctx.dry_run else "gpu"][model]
    autocast = model.startswith("mlp") and not ctx.dry_run  # bf16 on a CPU without AMX is 20x slower
    steps, warmup = (3, 1) if ctx.dry_run else (20, 3)
    x, y = data_for(shape, batch, ctx.device)
    lanes = devices.count(",") + 1
    makers: dict[str, Callable[[], tuple[Callable[[], None], Callable[[], object]]]] = {
        "nn.DataParallel": lambda: (data_parallel(build, x, y, autocast, lanes), lambda: None),
        "replicate": lambda: engine("replicate", devices, build, x, y, autocast),
        "persistent": lambda: engine("persistent", devices, build, x, y, autocast),
    }
    if lanes == 1:
        makers["plain loop"] = lambda: (plain_loop(build, x, y, autocast), lambda: None)
    loops, closers, failed = {}, [], {}
    for name, make in makers.items():
        try:
            step, close = make()
            closers.append(close)
            for _ in range(warmup):
                step()
            loops[name] = step
        except Exception as e:
            failed[name] = (
                f"could not run: {type(e).__name__}: {str(e).strip().splitlines()[0][:120] if str(e).strip() else ''}"
            )
    timed: dict[str, float | str] = dict(interleaved(loops, steps))
    for close in closers:
        close()
    if not ctx.dry_run:
        torch.cuda.empty_cache()
    return {name: timed.get(name, failed.get(name, "")) for name in makers}


def add_row(ctx: Context, case: str, t: float | str, ref: float | None, batch: int, flops, peak, ceiling) -> None:
    if isinstance(t, str):
        # NCCL refusing two ranks on one GPU, and FSDP2 over Gloo on GPU tensors, are torch's limits: told, not failed
        told = "NCCL" in case or ("FSDP2 (Gloo" in case and "on one GPU" in case)
        ctx.add(Row("speed", case, t, "", INFO if told else "fail"))
        return
    measured = f"{t * 1e3:.2f} ms, {batch / t:,.0f} samples/s"
    data: dict[str, float] = {"step_s": t, "samples_per_s": batch / t}
    if ref is not None:
        measured += f", {ref / t:.2f}x DataParallel"
        data["vs_data_parallel"] = ref / t
    expected = "nn.DataParallel can't split on CPU: plain module" if ctx.dry_run and "DataParallel" in case else ""
    if flops is not None:
        tflops = flops / t / 1e12
        measured += f", {tflops:.3g} TFLOP/s"
        data["tflops"] = tflops
        if peak:
            data["of_peak"] = tflops / peak
            expected = f"{100 * tflops / peak:.0f}% of {peak:.0f} (datasheet bf16)"
            if ceiling:
                expected += f", {100 * tflops / ceiling:.0f}% of matmul"
        elif ctx.dry_run:
            expected = "TFLOP/s vs peak: GPU only"
    ctx.add(Row("speed", case, measured, expected, PASS, data))


NCCL_REFUSED: list[str] = []  # once NCCL has refused two ranks on one GPU, it is not asked again


def ddp_rows(ctx: Context, model: str) -> dict[str, float | str]:
    """torch's DDP and FSDP2 on the same job, side by side (fsdp's step against ddp's, on
    Gloo in the dry run and on NCCL on a GPU machine)."""
    steps = 3 if ctx.dry_run else 10  # Gloo moves the MLP's 1 GB of gradients through the host every step
    if ctx.dry_run:
        return {
            "DDP (Gloo, 2 processes)": ddp_time(ctx, model, "gloo", steps),
            "FSDP2 (Gloo, 2 processes)": ddp_time(ctx, model, "gloo", steps, kind="fsdp"),
        }
    nccl = NCCL_REFUSED[0] if NCCL_REFUSED else ddp_time(ctx, model, "nccl", steps, deadline_s=45)
    if isinstance(nccl, float):
        return {
            "DDP (NCCL, 2 processes on one GPU)": nccl,
            "FSDP2 (NCCL, 2 processes on one GPU)": ddp_time(ctx, model, "nccl", steps, deadline_s=45, kind="fsdp"),
        }
    NCCL_REFUSED.append(nccl)
    return {
        "DDP (NCCL, 2 processes on one GPU)": f"NCCL did not run two ranks on one GPU: {nccl}",
        "DDP (Gloo, 2 processes on one GPU)": ddp_time(ctx, model, "gloo", steps),
        "FSDP2 (NCCL, 2 processes on one GPU)": "not run: NCCL refused two ranks on one GPU (above)",
        "FSDP2 (Gloo, 2 processes on one GPU)": ddp_time(ctx, model, "gloo", steps, kind="fsdp"),
    }


def matmul_tflops(n: int = 8192, reps: int = 10) -> float:
    """A large bf16 matrix product on random data: the card's practical ceiling (CUDA events)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * n**3 / statistics.median(times) / 1e12
