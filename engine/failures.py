"""Turning a failure into the one line a user reads."""

from __future__ import annotations

import traceback
from pathlib import Path

import torch

OOM_HINT = " (hint: a smaller batch, fewer replicas per GPU, or an uneven split)"


def one_line(e: BaseException) -> str:
    """The error as one line: its type and first line."""
    text = str(e).strip().splitlines()
    head = text[0] if text else ""
    # torch's replica errors read "Caught X in replica i on device d." then the original traceback:
    # keep that line and the original error's last line.
    if head.startswith("Caught ") and len(text) > 1:
        return f"{head} {text[-1].strip()}"
    return f"{type(e).__name__}: {head}" if head else type(e).__name__


def where(e: BaseException) -> str:
    """`` at file.py:LINE`` of the innermost frame, or nothing."""
    frames = traceback.extract_tb(e.__traceback__)
    return f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""


def release_cuda_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
