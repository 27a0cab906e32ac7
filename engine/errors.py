"""Errors that reach the user as one clear line instead of a traceback, and the exit codes the CLI ends with."""

EXIT_DIVERGED = 3
"""``multilane train`` (under ddp and fsdp, its launcher) and ``watch`` of a run that diverged: its loss
(or its weights) became NaN or inf, and its last checkpoint is its last finite state. The other codes:
0 finished or stopped by the user, 1 failed, 2 bad input (``UserError``), 130 aborted."""


class UserError(Exception):
    """Bad input from the user (a config value, a device list, a task file).

    The CLI prints ``multilane: error: <message>`` and exits with status 2; the app shows the message
    at the field or in a dialog. The message is always one line: a character that would break it (a
    newline or another control character inside a user's key, path or value) is shown escaped.
    """

    def __str__(self) -> str:
        return one_line_text(super().__str__())


class NothingToTrain(UserError):
    """A resume whose run has already trained its whole budget: the CLI says so and how to go on, exits 0
    (as Lightning and the HF Trainer do at their last epoch) and writes nothing to the run folder."""


def nothing_to_train(run: object, step: int, total: int) -> NothingToTrain:
    where = f"finished at step {step}/{total}" if step == total else f"at step {step}, past its budget of {total} steps"
    return NothingToTrain(
        f"{run}: {where}, nothing to train; to train on, resume with a larger budget: "
        f"multilane train --resume {run} --steps N (N > {step})"
    )


def one_line_text(text: str) -> str:
    """``text`` with every non-printable character escaped (``\\n``, ``\\x1c``), so it stays one line."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)
