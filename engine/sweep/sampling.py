"""How a sweep proposes parameters: Optuna's samplers, each trial's seeded from the study's seed and the
trial's number, so that every worker of one study proposes its own parameters; the pruners; the grid.

Why per trial: each worker process (the sweep, every ``sweep-worker``) builds its own sampler. Seeded
once per process from the study's seed, every worker drew the same random sequence, and N workers ran
each proposal N times. Trial numbers are unique in a study (the storage hands them out), so a sampler
seeded from ``(seed, number)`` proposes distinct parameters in every worker, and the same parameters for
the same trial number whichever worker asks it. Without ``--seed`` each trial takes fresh entropy."""

from __future__ import annotations

import secrets
import threading
from typing import Any

from multilane.engine.sweep.optuna_lib import optuna
from multilane.engine.sweep.spec import SweepSpec

# The median pruner waits for this many finished trials before it compares (Optuna's default is 5:
# a sweep of a handful of trials would never prune).
PRUNE_STARTUP = 2


def trial_seed(seed: int | None, number: int) -> int:
    """The seed of trial ``number``'s sampler: mixed from the study's seed and the number (numpy's
    SeedSequence, so nearby seeds and numbers give unrelated streams); fresh entropy without a seed."""
    import numpy as np

    if seed is None:
        return secrets.randbits(32)
    return int(np.random.SeedSequence([seed % 2**63, number]).generate_state(1)[0])


def per_trial_sampler_class() -> type:
    base = optuna().samplers.BaseSampler

    class PerTrialSeeded(base):  # type: ignore[misc, valid-type]
        """An Optuna sampler that builds a fresh inner sampler for each trial, seeded by ``trial_seed``."""

        def __init__(self, make: Any, seed: int | None) -> None:
            self._make, self._seed = make, seed
            self._inner: dict[int, Any] = {}
            self._lock = threading.Lock()

        def _for(self, trial: Any) -> Any:
            with self._lock:
                got = self._inner.get(trial.number)
                if got is None:
                    got = self._inner[trial.number] = self._make(trial_seed(self._seed, trial.number))
                return got

        def infer_relative_search_space(self, study: Any, trial: Any) -> Any:
            return self._for(trial).infer_relative_search_space(study, trial)

        def sample_relative(self, study: Any, trial: Any, search_space: Any) -> Any:
            return self._for(trial).sample_relative(study, trial, search_space)

        def sample_independent(self, study: Any, trial: Any, name: str, distribution: Any) -> Any:
            return self._for(trial).sample_independent(study, trial, name, distribution)

        def before_trial(self, study: Any, trial: Any) -> None:
            self._for(trial).before_trial(study, trial)

        def after_trial(self, study: Any, trial: Any, state: Any, values: Any) -> None:
            self._for(trial).after_trial(study, trial, state, values)
            with self._lock:
                self._inner.pop(trial.number, None)

        def reseed_rng(self) -> None:  # each trial is seeded from its number: nothing to reseed
            pass

    return PerTrialSeeded


def make_sampler(spec: SweepSpec) -> Any:
    """The sweep's sampler (TPE, random; a grid is enqueued whole, see ``enqueue_grid``), seeded per trial."""
    mod = optuna()
    if spec.sampler in ("random", "grid"):
        # Optuna's GridSampler calls study.stop() when the grid is done, which only works inside
        # study.optimize; slots ask and tell. So the grid is enqueued whole (enqueue_grid) when the
        # sweep is made, and an enqueued trial takes its params from the queue, whatever the sampler.
        def make(seed: int) -> Any:
            return mod.samplers.RandomSampler(seed=seed)
    else:
        # constant_liar: a running trial counts as a poor result, so parallel slots do not crowd one spot.
        def make(seed: int) -> Any:
            return mod.samplers.TPESampler(seed=seed, constant_liar=True)

    return per_trial_sampler_class()(make, spec.seed)


def enqueue_grid(study: Any, spec: SweepSpec) -> None:
    """Every combination of the grid, in an order shuffled by the seed (as Optuna's GridSampler picks), queued."""
    import itertools
    import random

    combos = list(itertools.product(*(p.grid() for p in spec.params)))
    random.Random(spec.seed).shuffle(combos)
    for values in combos:
        study.enqueue_trial({p.key: v for p, v in zip(spec.params, values, strict=True)})


def make_pruner(spec: SweepSpec) -> Any:
    mod = optuna()
    if spec.pruner == "none":
        return mod.pruners.NopPruner()
    if spec.pruner == "halving":
        return mod.pruners.SuccessiveHalvingPruner()
    return mod.pruners.MedianPruner(n_startup_trials=PRUNE_STARTUP, n_warmup_steps=0)
