"""The ``multilane`` command: its entry point, parser, ``train``, ``watch``/``control``/``devices``, and the progress display."""

from multilane.engine.cli.main import main

__all__ = ["main"]
