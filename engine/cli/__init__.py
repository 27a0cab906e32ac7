"""The ``multilane`` command: its entry point, parser, ``train``, ``watch``/``control``/``devices``, and the progress display."""

import sys


def main(argv: list[str] | None = None) -> int:
    """The ``multilane`` command. A Ctrl+C while its modules are still being imported (the first
    second or two) is the one line every interrupted set-up gets, not a traceback."""
    try:
        from multilane.engine.cli.main import main as run
    except KeyboardInterrupt:
        print("multilane: interrupted", file=sys.stderr)
        return 130
    return run(argv)


__all__ = ["main"]
