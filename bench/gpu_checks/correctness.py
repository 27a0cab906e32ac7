"""Correctness of one strategy: the engine's Trainer against one device and the whole batch, by hand.

For each device list (one device; two replicas on it) and precision (float32, bf16 autocast):

- ``mlp`` and ``batchnorm`` (with ``devices.sync_batchnorm``, so two devices must equal the whole
  batch on one): the engine's final weights and buffers against ``common.hand_loop``;
- ``dropout`` under activation checkpointing: each device draws its own dropout masks (by design,
  so a split run cannot equal one device), and the recompute in backward must replay them exactly:
  the run with checkpointing against the same run without.

ddp runs through ``multilane train --strategy ddp`` (a launcher and one process per device); two
processes on one GPU use the engine's choice of process group (Gloo where two ranks share a GPU),
and one more run asks for NCCL to record whether NCCL accepts two ranks on one GPU.
"""

from __future__ import annotations

import time
from typing import Any

from common import (
    FAIL,
    INFO,
    KNOWN,
    PASS,
    RECOMPUTE_TOLERANCE,
    SKIP,
    TOLERANCE,
    Context,
    Row,
    engine_ddp,
    engine_in_process,
    fmt,
    hand_loop,
    precise_math,
    rel_diff,
    run_config,
    task_params,
)

# Failures an open issue already names: (strategy, model, several devices) -> the issue.
KNOWN_FAILURES: dict[
    tuple[str, str, bool], str
] = {}  # (strategy, model, several devices) -> the issue that explains it


def cases(ctx: Context, strategy: str) -> list[tuple[str, str, str]]:
    """(devices, precision, model) to run. ddp starts a launcher and its processes for every run (~10 s
    each), so it runs fewer: on a GPU, one process with the MLP and two processes with every model in
    float32 and the MLP in bf16; in the dry run, two processes with the MLP (the rest is covered on CPU
    by tests/engine/distributed)."""
    if strategy == "fsdp":  # FSDP2 over NCCL: one process, and two (Gloo where they share one GPU)
        return [(ctx.two, "fp32", "mlp")] if ctx.dry_run else [(ctx.one, "fp32", "mlp"), (ctx.two, "fp32", "mlp")]
    if strategy == "ddp":
        if ctx.dry_run:
            return [(ctx.two, "fp32", "mlp")]
        two = [(ctx.two, "fp32", m) for m in ("mlp", "batchnorm", "dropout")] + [(ctx.two, "bf16", "mlp")]
        return [(ctx.one, "fp32", "mlp"), *two]
    return [
        (devices, precision, model)
        for devices in ctx.device_lists()
        for precision in ("fp32", "bf16")
        for model in ("mlp", "batchnorm", "dropout")
    ]


def ddp_library(devices: str) -> str:
    """Which library the engine's ddp picks here (devices.ddp_backend = auto), for the row to say."""
    from multilane.engine.distributed.rank import process_group_backend
    from multilane.engine.telemetry.devices import Device

    kind = "cuda" if devices.startswith("cuda") else "cpu"
    return {"nccl": "NCCL", "gloo": "Gloo"}[process_group_backend("auto", devices, Device(kind, 0))]


def train(ctx: Context, strategy: str, cfg: dict[str, Any]) -> tuple[str, str, dict | None]:
    if strategy in ("ddp", "fsdp"):
        return engine_ddp(cfg, ctx.workdir)
    return engine_in_process(cfg)


def run(ctx: Context, strategy: str) -> None:
    precise_math()
    name = f"correctness {strategy}"
    for devices, precision, model in cases(ctx, strategy):
        case = f"{model} {precision} [{devices}]" + (f" {ddp_library(devices)}" if strategy in ("ddp", "fsdp") else "")
        try:
            one_case(ctx, strategy, devices, precision, model, case)
        except Exception as e:  # this case's error is its row; the next case still runs
            ctx.add(Row(name, case, f"{type(e).__name__}: {e}"[:200], "no error", FAIL))
    if strategy == "ddp":
        ctx.add(nccl_on_one_gpu(ctx))


def one_case(ctx: Context, strategy: str, devices: str, precision: str, model: str, case: str) -> None:
    name, runs, several = f"correctness {strategy}", ctx.workdir / "runs", "," in devices
    t0 = time.monotonic()
    if model == "dropout":
        got_status, msg, got = train(
            ctx, strategy, run_config(task_params(model, checkpoint=True), devices, strategy, precision, runs)
        )
        _, msg_ref, ref = train(
            ctx, strategy, run_config(task_params(model, checkpoint=False), devices, strategy, precision, runs)
        )
        bound, what = RECOMPUTE_TOLERANCE, "vs same run without checkpointing"
    else:
        got_status, msg, got = train(ctx, strategy, run_config(task_params(model), devices, strategy, precision, runs))
        ref, msg_ref, bound, what = (
            hand_loop(task_params(model), precision, ctx.device),
            "",
            TOLERANCE[precision],
            "vs one device by hand",
        )
    seconds = time.monotonic() - t0
    if got is None or ref is None:
        ctx.add(Row(name, case, f"run {got_status}: {msg or msg_ref}"[:160], what, FAIL))
        return
    diff = rel_diff(got, ref)
    status = PASS if diff <= bound else FAIL
    known = KNOWN_FAILURES.get((strategy, model, several))
    if status == FAIL and known:
        status, what = KNOWN, f"{what}; {known}"
    ctx.add(
        Row(
            name,
            case,
            f"rel diff {fmt(diff)}",
            f"<= {fmt(bound)} ({what})",
            status,
            {"rel_diff": diff, "bound": bound, "seconds": round(seconds, 2)},
        )
    )


def nccl_on_one_gpu(ctx: Context) -> Row:
    """Whether NCCL takes two ranks on one GPU (it usually refuses: "Duplicate GPU detected")."""
    name = "correctness ddp"
    if ctx.dry_run:
        return Row(name, "NCCL, two processes on one GPU", "-", "GPU only", SKIP)
    cfg = run_config(task_params("mlp"), ctx.two, "ddp", "fp32", ctx.workdir / "runs", devices__ddp_backend="nccl")
    _, msg, got = engine_ddp(cfg, ctx.workdir)
    if got is None:
        return Row(
            name, "NCCL, two processes on one GPU", f"refused: {msg}"[:160], "Gloo then (engine's default)", INFO
        )
    diff = rel_diff(got, hand_loop(task_params("mlp"), "fp32", ctx.device))
    ok = PASS if diff <= TOLERANCE["fp32"] else FAIL
    return Row(name, "NCCL, two processes on one GPU", f"ran: rel diff {fmt(diff)}", f"<= {fmt(TOLERANCE['fp32'])}", ok)
