"""The training loop and its parts: the trainer, what a run trains, callbacks, checkpoints, the log window, evaluation, energy, optimizers, balance warnings, failures and run control."""

from multilane.engine.exports import lazy_exports

__getattr__, __all__ = lazy_exports(
    __name__,
    {
        "Trainer": "trainer",
        "RunResult": "callbacks",
        "TrainerCallback": "callbacks",
        "RunControl": "control",
    },
)
