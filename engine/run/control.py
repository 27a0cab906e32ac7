"""Pause and stop a run from another thread (the app's GUI thread, or a signal handler).

Only flags: the trainer checks them between steps, so a step always finishes whole.

A *hold* is a short pause that ends by itself: the app holds the run while it redraws its plots, so
that its GUI thread does not fight the training threads for the GIL (on a busy CPU its paints took up
to 60 ms, and training slowed too). See docs/app.md and docs/performance.md.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator

SETUP_SIGNAL = signal.SIGUSR2  # handled only while a run sets up: a stop asked from another thread


class SetupStopped(BaseException):
    """A stop asked while the run sets up (its fit check, loading data, building the model), raised in
    the setting-up thread wherever it is, so that a task's ``data()`` that never returns ends too.
    A ``BaseException``: the task's own ``except Exception`` does not swallow it."""


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
        self._setup_thread: int | None = None  # the thread setting a run up (``during_setup``)
        self._setup_lock = threading.Lock()

    def request_stop(self, reason: str | None = None) -> None:
        """Finish the current step, save a checkpoint, end the run as "stopped" (``reason``: why, in its
        end message; the first one given is kept)."""
        if reason and self.stop_reason is None:
            self.stop_reason = reason
        self._stop.set()
        self._running.set()  # a paused run wakes up to stop
        self._unheld.set()  # and a held one
        self._interrupt_setup()

    def _interrupt_setup(self) -> None:
        """During set-up: end it now. Asked in the setting-up thread (a signal handler: Ctrl+C, SIGTERM),
        raise here; asked from another thread (the control file's watcher, the app), signal that thread."""
        with self._setup_lock:
            ident = self._setup_thread
            if ident is None:
                return
            if threading.get_ident() == ident:
                self._setup_thread = None
                raise SetupStopped(self.stop_reason)
            if ident == threading.main_thread().ident:  # a real signal: it ends a wait in C (a sleep, a read)
                with contextlib.suppress(OSError, ValueError, ProcessLookupError):
                    signal.pthread_kill(ident, SETUP_SIGNAL)
            else:  # another thread (the app's): raised at its next Python line; a call blocked in C ends first
                _async_raise(ident, SetupStopped)

    def _on_setup_signal(self, signum: int, frame: object) -> None:
        if self._setup_thread is not None and self.stop_requested:
            self._setup_thread = None
            raise SetupStopped(self.stop_reason)

    @contextlib.contextmanager
    def during_setup(self, poll: Callable[[], object] | None = None, every_s: float = 0.25) -> Iterator[None]:
        """Make a stop end the set-up inside it at once (``SetupStopped``), wherever the set-up is (the
        task's own code included), with ``poll`` (the run folder's control file) called every
        ``every_s`` seconds meanwhile. In the main thread a signal delivers it (a call blocked in C ends
        too); in another thread (the app's) it is raised at the set-up's next Python line."""
        main = threading.current_thread() is threading.main_thread()
        old = signal.signal(SETUP_SIGNAL, self._on_setup_signal) if main else None
        done = threading.Event()

        def watch() -> None:
            while not done.wait(every_s):
                with contextlib.suppress(Exception):
                    if poll is not None:
                        poll()

        watcher = threading.Thread(target=watch, name="multilane-setup-control", daemon=True)
        self._setup_thread = threading.get_ident()
        try:  # a stop asked before the set-up began is the loop's: set up, then stop at once with a checkpoint
            watcher.start()
            yield
        finally:
            with self._setup_lock:
                self._setup_thread = None
                if not main:
                    _async_raise(threading.get_ident(), None)  # one asked a moment ago is not for the loop
            done.set()
            if watcher.is_alive():
                watcher.join()
            if main:
                signal.signal(SETUP_SIGNAL, old)

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


def _async_raise(ident: int, exc: type[BaseException] | None) -> None:
    """Raise ``exc`` in thread ``ident`` at its next Python line (None: take back one not raised yet)."""
    import ctypes

    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(exc) if exc else None)
