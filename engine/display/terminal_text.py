"""Text from outside the program (a run folder, a host, a task's messages) made safe to print on a terminal.

A run folder's ``status.json``, a warning event or a host's answer can hold anything its writer put
there, including terminal control sequences: ``ESC ] 0 ;`` sets the window title, ``ESC ] 52 ;`` writes
the clipboard, ``ESC [ 2 J`` clears the screen, a lone ``\\r`` redraws the line over what was shown.
``printable`` shows every such character escaped, as Python writes it in a string (``\\x1b``, ``\\r``,
``\\x9b``, ``\\u202e``), so the text is seen, never obeyed. Shared by every command that prints such
text (``watch``, ``control``, ``export``, ``train``'s progress line, the remote commands) and the window.

What is escaped: every control character (Unicode category Cc: C0 ``\\x00``-``\\x1f`` with the tab and
the newline, since each line printed is one line; DEL; C1 ``\\x80``-``\\x9f``, where ``\\x9b`` is a
one-byte ESC [ on some terminals), every format character (Cf: the bidirectional overrides and
isolates, which reorder what is shown, and the zero-width ones, which hide it), the line and paragraph
separators (Zl, Zp) and lone surrogates (Cs). A backslash itself is left as it is. Everything else
(accents, CJK, emoji, a non-breaking space) is kept as it is.
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
