"""The machine the check ran on: the card, its driver, torch and CUDA, and the card's bf16 matrix rate.

The rate is the datasheet's dense bf16 figure for the card's name (a lead, not a reading; the speed
check also measures a large bf16 matrix product on the card, the ceiling to compare with in practice).
"""

from __future__ import annotations

import platform
import shutil
import subprocess
import sys

import torch
from common import INFO, PASS, SKIP, Context, Row

# Dense bf16 tensor-core TFLOP/s by the vendor's datasheets, first match of the name wins (nvidia-smi
# names the H100 SXM "NVIDIA H100 80GB HBM3"). A card not here gets TFLOP/s without a fraction of peak.
BF16_PEAK_TFLOPS: list[tuple[str, float]] = [
    ("H200 NVL", 835.0),
    ("H200", 989.0),
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
]


def bf16_peak(name: str) -> float | None:
    """The datasheet dense bf16 rate (TFLOP/s) of a card named ``name``, or None for a card not in the table."""
    for key, peak in BF16_PEAK_TFLOPS:
        if key.lower() in name.lower():
            return peak
    return None


def nvidia_smi(*fields: str) -> list[str] | None:
    """One GPU's ``nvidia-smi --query-gpu`` fields (the first GPU), or None without nvidia-smi."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    r = subprocess.run(
        [exe, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits", "--id=0"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if r.returncode != 0 or not r.stdout.strip():
        return None
    return parse_smi_line(r.stdout.strip().splitlines()[0])


def parse_smi_line(line: str) -> list[str]:
    return [v.strip() for v in line.split(",")]


def nccl_version() -> str | None:
    try:
        v = torch.cuda.nccl.version()
    except Exception:
        return None
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def describe(ctx: Context) -> dict:
    """The facts the report's header and the docs' results section need."""
    import multilane.engine

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "multilane": multilane.engine.__version__,
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, {__import__('os').cpu_count()} cores",
        "dry_run": ctx.dry_run,
    }
    if not ctx.dry_run:
        props = torch.cuda.get_device_properties(0)
        info.update(
            card=props.name,
            compute_capability=f"{props.major}.{props.minor}",
            memory_gib=round(props.total_memory / 2**30, 1),
            multiprocessors=props.multi_processor_count,
            cuda=torch.version.cuda,
            cudnn=torch.backends.cudnn.version(),
            nccl=nccl_version(),
            bf16_peak_tflops=bf16_peak(props.name),
        )
        smi = nvidia_smi("driver_version", "name")
        info["driver"] = smi[0] if smi else None
    return info


def run(ctx: Context) -> None:
    info = describe(ctx)
    for k, v in info.items():
        ctx.add(Row("environment", k, str(v), "", INFO, {"value": v}))
    if ctx.dry_run:
        ctx.add(Row("environment", "GPU", "-", "GPU only (dry run on CPU lanes)", SKIP))
    else:
        ok = torch.cuda.is_available() and torch.cuda.device_count() >= 1
        ctx.add(Row("environment", "CUDA available", str(ok), "True", PASS if ok else "fail"))
    try:
        import pydantic  # noqa: F401  (the engine's config needs it; the GPU machine has it only carried)

        ctx.add(Row("environment", "pydantic importable", "yes", "yes", PASS, {"python": sys.version}))
    except ImportError as e:
        ctx.add(Row("environment", "pydantic importable", str(e), "yes (bench/gpu_wheels.sh)", "fail"))
