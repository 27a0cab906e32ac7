"""Hyperparameter sweeps on Optuna: the search space, the study and its storage (checked), proposals, lost-trial recovery, device slots, trial processes and their guards, and the sweep loop."""

from multilane.engine.exports import lazy_exports

__getattr__, __all__ = lazy_exports(
    __name__,
    {
        "ParamSpec": "space",
        "parse_param": "space",
        "SweepSpec": "spec",
        "Sweep": "study",
        "recover_lost": "recovery",
        "split_slots": "slots",
        "SweepRunner": "runner",
        "trial_rows": "rows",
    },
)
