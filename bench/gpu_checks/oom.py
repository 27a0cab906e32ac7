"""Out of memory on the GPU: an oversized batch fails the run with the engine's one line and its hint, and
a following run in the same process succeeds (the engine gives the cached memory back).

The model is one wide hidden layer (``task.py``'s ``wide``, 2**20 units, 130 MB of weights): a batch of
131072 samples needs 512 GiB of activations, far past any card; a batch of 64 needs 256 MiB.
"""

from __future__ import annotations

import gc

import torch
from common import FAIL, PASS, Context, Row, engine_in_process, run_config, task_params

BIG, SMALL = 131072, 64


def run(ctx: Context) -> None:
    from multilane.engine.run.failures import OOM_HINT

    for devices in ctx.device_lists():
        try:
            oversized_then_small(ctx, devices, OOM_HINT)
        except Exception as e:  # this device list's error is its row; the next one still runs
            ctx.add(Row("out of memory", f"[{devices}]", f"{type(e).__name__}: {e}"[:200], "no error", FAIL))


def oversized_then_small(ctx: Context, devices: str, hint: str) -> None:
    """The oversized batch, then a small one, on ``devices``: three rows."""
    runs = ctx.workdir / "runs"
    big = run_config(task_params("wide", samples=BIG), devices, "replicate", "fp32", runs, train__steps=2)
    status, message, _ = engine_in_process(big)
    gc.collect()
    allocated_gib = torch.cuda.memory_allocated(0) / 2**30 if torch.cuda.is_available() else 0.0
    reported = status == "failed" and "out of memory" in message.lower() and hint.strip() in message
    ctx.add(
        Row(
            "out of memory",
            f"batch {BIG} on [{devices}]",
            f"{status}: {message}"[:200],
            "failed, 'out of memory' and the hint",
            PASS if reported else FAIL,
            {"message": message},
        )
    )
    ctx.add(
        Row(
            "out of memory",
            f"memory after it [{devices}]",
            f"{allocated_gib:.2f} GiB allocated",
            "< 1 GiB (released)",
            PASS if allocated_gib < 1 else FAIL,
        )
    )
    small = run_config(task_params("wide", samples=SMALL), devices, "replicate", "fp32", runs, train__steps=2)
    status, message, state = engine_in_process(small)
    ok = status == "finished" and state is not None
    ctx.add(
        Row(
            "out of memory",
            f"then batch {SMALL} on [{devices}]",
            f"{status} {message}"[:200],
            "finished, same process",
            PASS if ok else FAIL,
        )
    )
