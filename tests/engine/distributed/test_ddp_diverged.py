"""A NaN never reaches a ddp checkpoint: the ranks agree on the check before each save (one device read
each, then a tiny all-reduce), so a loss or an update that went non-finite between two log points leaves
``last.pt`` at the last finite step, equal to the single-process engine's straight run; the run is
``diverged``, the launcher exits 3, and the run resumes from it. Real launches: 2 ranks, Gloo, float64."""

from __future__ import annotations

import pytest
from helpers import check_diverged_launch, resume_clean

pytestmark = pytest.mark.timeout(600)


# "weights" (one launch, ~2 s with the warm ranks) stays in the fast tier; "loss" also resumes.
@pytest.mark.parametrize("how", [pytest.param("loss", marks=pytest.mark.slow), "weights"])
def test_ddp_keeps_the_last_finite_checkpoint_and_ends_diverged(tmp_path, how):
    run = check_diverged_launch(tmp_path, "ddp", how)
    if how == "loss":
        resume_clean(tmp_path, run, "ddp")
