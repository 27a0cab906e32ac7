"""Pause and stop a run from another thread (the app's GUI thread, or a signal handler).

Only flags: the trainer checks them between steps, so a step always finishes whole.

A *hold* is a short pause that ends by itself: the app holds the run while it redraws its plots, so
that its GUI thread does not fight the training threads for the GIL (on a busy CPU its paints took up
to 60 ms, and training slowed too). See docs/app.md and docs/performance.md.
"""

from __future__ import annotations

import threading
import time


class RunControl:
    def __init__(self) -> None:
        self._stop = threading.Event()
        self._running = threading.Event()
        self._running.set()
        self._unheld = threading.Event()
        self._unheld.set()
        self._waiting = threading.Event()  # set while the trainer waits on a hold
        self._hold_until = 0.0
        self.held_s = 0.0  # time the trainer spent waiting on holds (read it after the run)
        self.stop_reason: str | None = None  # who asked, when they said (a sweep's pruner): in the end message

    def request_stop(self, reason: str | None = None) -> None:
        """Finish the current step, save a checkpoint, end the run as "stopped" (``reason``: why, in its
        end message; the first one given is kept)."""
        if reason and self.stop_reason is None:
            self.stop_reason = reason
        self._stop.set()
        self._running.set()  # a paused run wakes up to stop
        self._unheld.set()  # and a held one

    def pause(self) -> None:
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    def hold(self, max_s: float) -> None:
        """Keep the trainer from starting another step until ``release()``, or ``max_s`` seconds at most."""
        self._hold_until = time.monotonic() + max_s
        self._unheld.clear()

    def release(self) -> None:
        self._unheld.set()

    def wait_until_held(self, timeout: float) -> bool:
        """After ``hold()``: block until the trainer has finished its step and is waiting (True), or
        for ``timeout`` seconds (False: it is still busy, in a long step, an evaluation, a pause)."""
        return self._waiting.wait(timeout)

    @property
    def stop_requested(self) -> bool:
        return self._stop.is_set()

    @property
    def pause_requested(self) -> bool:
        return not self._running.is_set()

    def wait_while_paused(self, timeout: float | None = None) -> bool:
        """Block while paused; True once running (or stopping) again."""
        return self._running.wait(timeout)

    def wait_while_held(self) -> None:
        """Called by the trainer between steps: returns at once unless a hold is on."""
        if self._unheld.is_set():
            return
        left = self._hold_until - time.monotonic()
        if left > 0:
            t0 = time.monotonic()
            self._waiting.set()
            try:
                self._unheld.wait(left)
            finally:
                self._waiting.clear()
            self.held_s += time.monotonic() - t0
