"""The one place the SSH library (paramiko) is imported: remote hosts are an optional extra.

paramiko rather than asyncssh: every caller here is synchronous (the CLI's loop, the window's worker
thread), and paramiko tells an unknown host key (``MissingHostKeyPolicy``) from a changed one
(``BadHostKeyException``), the two cases a user must be told apart. docs/remote.md says more.
"""

from __future__ import annotations

import logging
from types import ModuleType

from multilane.engine.errors import UserError

MISSING = "remote hosts need paramiko: pip install 'multilane[remote]'"


def paramiko() -> ModuleType:
    """The paramiko module, or one line naming the extra to install."""
    try:
        import paramiko as module
    except ImportError:
        raise UserError(MISSING) from None
    # paramiko logs a failed connection's traceback from its own thread; the caller reports it in one line
    logging.getLogger("paramiko").addHandler(logging.NullHandler())
    logging.getLogger("paramiko").propagate = False
    return module
