"""The ``multilane`` command: its entry point, parser, ``train``, ``watch``/``control``/``devices``, the remote and sweep commands."""

import sys

from multilane.engine.cli.interrupts import hold_ctrl_c_while_extensions_load, note_ctrl_c

# Before the command's own modules load (psutil's extension among them): a press there is held while an
# extension starts, and noted if its KeyboardInterrupt is lost (interrupts.py); main() does both again.
hold_ctrl_c_while_extensions_load()
note_ctrl_c()

try:
    from multilane.engine.cli.main import main
except KeyboardInterrupt:  # Ctrl+C while the command's modules load: the one line, not a traceback
    print("multilane: interrupted", file=sys.stderr)
    sys.exit(130)

__all__ = ["main"]
