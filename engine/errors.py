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


WARNINGS_SHOWN_ENV = "MULTILANE_WARNINGS_SHOWN"


def show_warnings_once() -> None:
    """From now on this process shows each warning (category, text, file and line) at most once.

    Python's default already shows a warning once per place, but it keeps that record per module and
    forgets it whenever any code changes the warning filters (a ``warnings.catch_warnings`` block, a
    module that calls ``filterwarnings`` as it is imported: torch's lazy imports do, mid-run): a model's
    own warning then came back after a few steps. A user who asks for more (``python -W ...``,
    ``PYTHONWARNINGS``) keeps Python's own rules.

    With ``$MULTILANE_WARNINGS_SHOWN`` naming a folder (a ddp/fsdp launcher makes one for its ranks),
    "once" holds across the processes that share it: the first to show a warning leaves a file named for
    it there, and the others (the other ranks, and the ranks after the launcher's fit-check probe) skip it."""
    import hashlib
    import os
    import sys
    import warnings

    show = warnings.showwarning
    if sys.warnoptions or getattr(show, "once", False):
        return
    shown: set[tuple[type, str, str, int]] = set()

    def once(message, category, filename, lineno, file=None, line=None):  # warnings.showwarning's signature
        key = (category, str(message), filename, lineno)
        if key in shown:
            return
        shown.add(key)
        folder = os.environ.get(WARNINGS_SHOWN_ENV)
        if folder:
            name = hashlib.sha256(repr((category.__qualname__, *key[1:])).encode()).hexdigest()[:32]
            try:
                os.close(os.open(os.path.join(folder, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            except FileExistsError:
                return  # another process of the run showed it
            except OSError:
                pass  # the folder is gone: show it
        show(message, category, filename, lineno, file, line)

    once.once = True  # type: ignore[attr-defined]
    warnings.showwarning = once


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
    import traceback
    from pathlib import Path

    frames = traceback.extract_tb(e.__traceback__)
    return f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
