"""Turning a failure into the one line a user reads."""

from __future__ import annotations

import errno
import re
from pathlib import Path

import torch
from multilane.engine.errors import one_line, where  # noqa: F401 (where: the CLI reads both here)

OOM_HINT = " (hint: a smaller batch, fewer replicas per GPU, or an uneven split)"
CPU_OOM_HINT = " (hint: a smaller batch, fewer lanes or DataLoader workers, or more free memory on this machine)"
# torch's CPU allocator raises a plain RuntimeError, worded for its own developers.
CPU_OOM = re.compile(r"DefaultCPUAllocator: can't allocate memory: you tried to allocate (\d+) bytes")
REPLICA = re.compile(r"^Caught \w+ (in replica \d+ on device \S+?)\.")


def cpu_out_of_memory(e: BaseException) -> str | None:
    """ "out of CPU memory (tried to allocate 1.5 GiB) in replica i on device d", if ``e`` is torch's
    CPU allocator failing (in a lane or not); else None."""
    text = str(e)
    m = CPU_OOM.search(text)
    if m is None:
        return None
    size = float(m.group(1))
    unit = "bytes"
    for name in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        if size < 1024:
            break
        size, unit = size / 1024, name
    replica = REPLICA.match(text)
    return f"out of CPU memory (tried to allocate {size:,.1f} {unit})" + (f" {replica.group(1)}" if replica else "")


def release_cuda_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


DISK_FULL = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is used up",
    errno.EFBIG: "a file size limit",
}


def disk_full(e: BaseException) -> str | None:
    """What ran out, if ``e`` is a write that found no room (ENOSPC, EDQUOT, EFBIG); else None."""
    return DISK_FULL.get(getattr(e, "errno", None) or -1) if isinstance(e, OSError) else None


def outcome(
    e: BaseException, task: str, step: int, run_dir: Path | None, checkpoint_step: int | None
) -> tuple[str, str]:
    """The recorded state and its one-line message for whatever ended a run: (status, message)."""
    kept = (
        f"the last checkpoint (step {checkpoint_step}) is intact"
        if checkpoint_step is not None
        else "there is no checkpoint yet"
    )
    if isinstance(e, KeyboardInterrupt):
        return "aborted", f"aborted during step {step} (a second Ctrl+C or SIGTERM); {kept}"
    if isinstance(e, SystemExit):
        return "failed", f"task {task}, step {step}: the task's code called sys.exit({e.code!r}); {kept}"
    full = disk_full(e)
    if full:
        assert isinstance(e, OSError)
        name = re.sub(r"^\.(.+)\.\d+\.tmp$", r"\1", Path(e.filename).name) if e.filename else "a file"
        where = f" in {run_dir}" if run_dir is not None else ""
        return "failed", f"no room to write {name}{where}: {full} ({e.strerror}); {kept}; free space, then resume"
    cpu_oom = cpu_out_of_memory(e)
    if cpu_oom is not None:
        return "failed", f"task {task}, step {step}: {cpu_oom}{CPU_OOM_HINT}; {kept}"
    message = f"task {task}, step {step}: {one_line(e)}"
    if isinstance(e, torch.OutOfMemoryError):
        message += OOM_HINT
    return "failed", message
