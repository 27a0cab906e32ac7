"""The ``multilane`` command: its entry point, parser, ``train``, ``watch``/``control``/``devices``, the remote and sweep commands."""

import sys

try:
    from multilane.engine.cli.main import main
except KeyboardInterrupt:  # Ctrl+C while the command's modules load: the one line, not a traceback
    print("multilane: interrupted", file=sys.stderr)
    sys.exit(130)

__all__ = ["main"]
