"""Errors that reach the user as one clear line instead of a traceback."""


class UserError(Exception):
    """Bad input from the user (a config value, a device list, a task file).

    The CLI prints ``multilane: error: <message>`` and exits with status 2; the app shows the message
    at the field or in a dialog.
    """
