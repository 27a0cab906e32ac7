"""A NaN never reaches an fsdp checkpoint: every rank checks its own shards and the open window's loss,
and the ranks agree before any of them writes, so no sharded folder of a non-finite state is written;
``last.pt`` names the last finite step's folder, equal to the single-process engine's straight run; the
run is ``diverged``, exit 3, and resumes. Real launches: 2 ranks, Gloo, float64. The checks are
tests/engine/distributed/test_ddp_diverged.py's."""

from __future__ import annotations

import pytest
import torch
from helpers import DIVERGE_LAST_GOOD, TESTS

pytestmark = pytest.mark.timeout(600)


def ddp_checks():
    import importlib.util

    spec = importlib.util.spec_from_file_location("ddp_diverged", TESTS / "engine/distributed/test_ddp_diverged.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# "weights" (one launch, ~2 s with the warm ranks) stays in the fast tier; "loss" also resumes.
@pytest.mark.parametrize("how", [pytest.param("loss", marks=pytest.mark.slow), "weights"])
def test_fsdp_keeps_the_last_finite_sharded_checkpoint_and_ends_diverged(tmp_path, how):
    checks = ddp_checks()
    run = checks.check_diverged(tmp_path, "fsdp", how)
    ck = torch.load(run / "checkpoints" / "last.pt", weights_only=True)
    folders = sorted(p.name for p in (run / "checkpoints").iterdir() if p.is_dir())
    assert folders == [ck["sharded"]] and ck["sharded"].startswith(f"sharded-{DIVERGE_LAST_GOOD}-"), folders
    if how == "loss":
        checks.resume_clean(tmp_path, run, "fsdp")
