"""Text from a run folder or a host is data on a terminal: ``printable`` escapes every control character
(C0, DEL, C1, and the bidirectional and zero-width format characters that reorder or hide what is
shown), so a status message cannot set the terminal's title, clear its screen or move its cursor.

An escaped character reads as Python writes it (``\\x1b``, ``\\n``, ``\\u202e``); a backslash itself is
left as it is. Everything else, any script or emoji, passes unchanged.
"""

from __future__ import annotations

import unicodedata

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(c: str) -> str:
    if c in _NAMED:
        return _NAMED[c]
    n = ord(c)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


def _unsafe(c: str) -> bool:
    return unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp", "Cs")


def printable(s: str) -> str:
    """``s`` with every control or format character escaped (``"\\x1b]0;x\\x07"`` → ``"\\\\x1b]0;x\\\\x07"``)."""
    if s.isprintable():  # the common case: nothing to do (isprintable is False for every unsafe one)
        return s
    return "".join(_escape(c) if _unsafe(c) else c for c in s)
