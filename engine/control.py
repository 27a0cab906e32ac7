"""Pause and stop a run from another thread (the app's GUI thread, or a signal handler).

Only flags: the trainer checks them between steps, so a step always finishes whole.
"""

from __future__ import annotations

import threading


class RunControl:
    def __init__(self) -> None:
        self._stop = threading.Event()
        self._running = threading.Event()
        self._running.set()

    def request_stop(self) -> None:
        """Finish the current step, save a checkpoint, end the run as "stopped"."""
        self._stop.set()
        self._running.set()  # a paused run wakes up to stop

    def pause(self) -> None:
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    @property
    def stop_requested(self) -> bool:
        return self._stop.is_set()

    @property
    def pause_requested(self) -> bool:
        return not self._running.is_set()

    def wait_while_paused(self, timeout: float | None = None) -> bool:
        """Block while paused; True once running (or stopping) again."""
        return self._running.wait(timeout)
