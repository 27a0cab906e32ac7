"""Text from outside the program (a run folder, a host, a task's messages) made safe to print on a terminal.

A run folder's ``status.json`` or a warning event can hold anything its writer put there, including
terminal control sequences: ``ESC ] 0 ;`` sets the window title, ``ESC ] 52 ;`` writes the clipboard,
``ESC [ 2 J`` clears the screen, a lone ``\\r`` redraws the line over what was shown. ``printable``
shows every such character escaped, as Python writes it in a string (``\\x1b``, ``\\r``, ``\\x9b``),
so the text is seen, never obeyed. Shared by every command that prints such text (``watch``,
``control``, ``export``, ``train``'s progress line, the remote commands).

What is escaped: every C0 control (``\\x00``-``\\x1f``, the tab and the newline too: the lines
printed are one line each, and a tab's width would push the rest of the line out of place), DEL
(``\\x7f``), every C1 control (``\\x80``-``\\x9f``: ``\\x9b`` is a one-byte ESC [ on some terminals), the
line and paragraph separators (U+2028, U+2029) and the bidirectional overrides and isolates
(U+202A-U+202E, U+2066-U+2069), which reorder what is shown. Everything else (accents, CJK, emoji,
a non-breaking space) is kept as it is.
"""

from __future__ import annotations

import re

_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def _escape(m: re.Match[str]) -> str:
    return m.group().encode("unicode_escape").decode("ascii")


def printable(s: str) -> str:
    """``s`` with every control character escaped (``"\\x1b]0;pwned\\x07"`` → ``"\\\\x1b]0;pwned\\\\x07"``)."""
    if s.isascii() and s.isprintable():  # the common case, at C speed
        return s
    return _UNSAFE.sub(_escape, s)
