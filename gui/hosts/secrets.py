"""Passwords and key passphrases for SSH hosts, asked in the window for a connection made in a worker
thread, and never written anywhere.

``Connection`` calls its ``ask`` in the thread that connects (the window connects in worker threads
only: reading a host's devices, a remote run's follower, the list of runs to resume there). An
``Asker`` is that ``ask``: it sends the question to the GUI thread (a queued signal), where a
non-modal password box (``QLineEdit.Password`` echo) is opened; the worker thread waits on an event
while the window stays live. Cancel, or closing the window, ends the wait with ``NotGiven``: one
line, and the attempt ends (no retry loop).

A secret that connected is kept in this process's memory for the rest of the session, per host, so
that a follower reconnecting after a drop, or Start after the device list, does not ask again; a
secret that failed is forgotten. Nothing here touches QSettings or any file.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from multilane.engine.remote.connection import NotGiven
from PySide6.QtCore import QObject, Qt, QThread, Signal
from PySide6.QtWidgets import QInputDialog, QLineEdit, QWidget

WAIT_SLICE_S = 0.5  # how often a waiting worker thread checks that the window is still there


@dataclass
class _Request:
    host: str
    prompt: str
    done: threading.Event = field(default_factory=threading.Event)
    answer: str | None = None


class HostSecrets(QObject):
    """The window's password asker; ``asker(host)`` is a ``Connection``'s ``ask`` for that host."""

    _wanted = Signal(object)  # a _Request, from a worker thread to the GUI thread

    def __init__(self, parent: QWidget) -> None:
        super().__init__(parent)
        self.window = parent
        self._known: dict[str, str] = {}  # host -> a secret that connected there (memory only)
        self._lock = threading.Lock()
        self._one_box = threading.Lock()  # one password box at a time
        self._closed = False
        self.box: QInputDialog | None = None  # the open box (tests answer it)
        self.asked = 0  # how many boxes were opened: a follower's reconnect must not add one
        self._wanted.connect(self._show, Qt.QueuedConnection)

    def asker(self, host: str) -> Asker:
        return Asker(self, host)

    # -- worker threads ----------------------------------------------------------------------------
    def _ask(self, host: str, prompt: str) -> str:
        if QThread.currentThread() is self.thread():  # the box needs this thread's event loop: never block it
            raise NotGiven(f"{host}: a password or passphrase is needed, and cannot be asked from the GUI thread")
        with self._one_box:
            with self._lock:
                known = self._known.get(host)  # given meanwhile in another box
            if known is not None:
                return known
            request = _Request(host, prompt)
            self._wanted.emit(request)
            while not request.done.wait(WAIT_SLICE_S):
                if self._closed:
                    break
        if not request.answer:
            raise NotGiven(f"{host}: no password or passphrase given; not connected")
        return request.answer

    def known(self, host: str) -> str | None:
        with self._lock:
            return self._known.get(host)

    def remember(self, host: str, secret: str) -> None:
        with self._lock:
            self._known[host] = secret

    def forget(self, host: str) -> None:
        with self._lock:
            self._known.pop(host, None)

    # -- the GUI thread ----------------------------------------------------------------------------
    def _show(self, request: _Request) -> None:
        if self._closed:
            request.done.set()
            return
        self.asked += 1
        box = QInputDialog(self.window.window())
        box.setObjectName("host_secret")
        box.setWindowTitle(f"SSH: {request.host}")
        box.setLabelText(f"The {request.prompt}:\n(kept in memory for this session only, never saved)")
        box.setTextEchoMode(QLineEdit.Password)
        box.setInputMode(QInputDialog.TextInput)
        box.setOkButtonText("Connect")

        def finished(result: int) -> None:
            request.answer = box.textValue() if result == QInputDialog.Accepted else None
            box.setTextValue("")  # the box's copy goes at once
            request.done.set()
            if self.box is box:
                self.box = None
            box.deleteLater()

        box.finished.connect(finished)
        self.box = box
        box.open()  # window-modal at most, never a nested event loop in the GUI thread

    def close(self) -> None:
        """The window closes: every waiting worker thread gets ``NotGiven``; the secrets go."""
        self._closed = True
        with self._lock:
            self._known.clear()
        if self.box is not None:
            self.box.reject()


class Asker:
    """``ask`` for one connection attempt to ``host``: a secret that connected there this session, or
    the user's answer. ``done(ok)`` after the attempt keeps an answer that connected, forgets one that
    did not."""

    def __init__(self, secrets: HostSecrets, host: str) -> None:
        self.secrets, self.host = secrets, host
        self._given: str | None = None

    def __call__(self, prompt: str) -> str | None:
        known = self.secrets.known(self.host)
        self._given = known if known is not None else self.secrets._ask(self.host, prompt)
        return self._given

    def done(self, ok: bool) -> None:
        if self._given is None:
            return
        if ok:
            self.secrets.remember(self.host, self._given)
        else:
            self.secrets.forget(self.host)
        self._given = None


def attempt_done(ask: Any, ok: bool) -> None:
    """Tell an ``Asker`` (or any ``ask`` without ``done``) how the attempt went."""
    done = getattr(ask, "done", None)
    if callable(done):
        done(ok)
