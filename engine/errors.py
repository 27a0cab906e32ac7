"""Errors that reach the user as one clear line instead of a traceback, and the exit codes the CLI ends with."""

EXIT_FAILED = 1
"""``multilane train`` (and ``watch``): the run failed (an error in the task, a rank, the disk)."""
EXIT_BAD_INPUT = 2
"""Bad input (``UserError``): one line on stderr, nothing trained."""
EXIT_DIVERGED = 3
"""The run diverged: its loss (or its weights) became NaN or inf; the last checkpoint is the last finite state."""


class UserError(Exception):
    """Bad input from the user (a config value, a device list, a task file).

    The CLI prints ``multilane: error: <message>`` and exits with status 2; the app shows the message
    at the field or in a dialog. The message is always one line: a character that would break it (a
    newline or another control character inside a user's key, path or value) is shown escaped.
    """

    def __str__(self) -> str:
        return one_line_text(super().__str__())


def one_line_text(text: str) -> str:
    """``text`` with every non-printable character escaped (``\\n``, ``\\x1c``), so it stays one line."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)
