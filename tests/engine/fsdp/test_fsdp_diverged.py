"""A NaN never reaches an fsdp checkpoint: every rank checks its own shards and the open window's loss,
and the ranks agree before any of them writes, so no sharded folder of a non-finite state is written;
``last.pt`` names the last finite step's folder, equal to the single-process engine's straight run; the
run is ``diverged``, exit 3, and resumes. Real launches: 2 ranks, Gloo, float64. The checks are
shared with ddp's (tests/helpers.py, ``check_diverged_launch``)."""

from __future__ import annotations

import pytest
import torch
from helpers import DIVERGE_LAST_GOOD, check_diverged_launch, resume_clean

pytestmark = pytest.mark.timeout(600)


# "weights" (one launch, ~2 s with the warm ranks) stays in the fast tier; "loss" also resumes.
@pytest.mark.parametrize("how", [pytest.param("loss", marks=pytest.mark.slow), "weights"])
def test_fsdp_keeps_the_last_finite_sharded_checkpoint_and_ends_diverged(tmp_path, how):
    run = check_diverged_launch(tmp_path, "fsdp", how)
    ck = torch.load(run / "checkpoints" / "last.pt", weights_only=True)
    folders = sorted(p.name for p in (run / "checkpoints").iterdir() if p.is_dir())
    assert folders == [ck["sharded"]] and ck["sharded"].startswith(f"sharded-{DIVERGE_LAST_GOOD}-"), folders
    if how == "loss":
        resume_clean(tmp_path, run, "fsdp")
