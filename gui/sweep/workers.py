"""The Sweep tab's "Workers on hosts": the sweep's storage (a PostgreSQL URL that hosts can reach, or
the sweep folder's own journal), and ``multilane sweep-worker`` started on a known SSH host (the window's
host list) on the devices named, stopped, and shown while it runs. The SSH work runs in threads; the
workers run detached on their hosts and end when the sweep reaches its count (closing the app leaves
them be). engine/remote/sweep_worker.py does the work."""

from __future__ import annotations

import threading
from typing import Any

from multilane.engine.errors import UserError
from multilane.gui.hosts.host_bar import THIS_COMPUTER
from PySide6.QtCore import QTimer, Signal
from PySide6.QtWidgets import (
    QComboBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QListWidget,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

POLL_MS = 3000
NO_HOSTS = "no SSH hosts yet: add one with the Setup tab's host list (Add host…)"


class HostWorkers(QWidget):
    """Storage field, host and devices pickers, Start worker there / Stop worker, and the started workers."""

    sigResult = Signal(object, object, object)  # what ("started", "stopped", "state", "error"), its entry, a text

    def __init__(self, tab: Any) -> None:
        super().__init__()
        self.tab = tab  # the Sweep tab: its sweep (study name, storage) and its window's host list
        self.entries: list[dict[str, Any]] = []  # one a started worker: worker, conn, state
        self._said = ""
        self.storage = QLineEdit()
        self.storage.setObjectName("sweep_storage")
        self.storage.setPlaceholderText("the sweep folder's study.journal, or postgresql+psycopg://…")
        self.storage.setToolTip(
            "Where the study lives (empty: the sweep folder's study.journal). A PostgreSQL URL that your hosts can "
            "reach (postgresql+psycopg://USER:PASSWORD@DBHOST/DB) lets workers on them join the sweep; its password is passed on standard input, never on a command line"
        )
        self.host = QComboBox()
        self.host.setObjectName("worker_host")
        self.host.setToolTip("A host of the Setup tab's host list (your ~/.ssh/config and the hosts you added)")
        self.devices = QLineEdit()
        self.devices.setObjectName("worker_devices")
        self.devices.setPlaceholderText("auto")
        self.devices.setToolTip("The host's devices, split into slots as the sweep's: cuda:0,cuda:1 or cpu:0,cpu:1")
        self.start_btn = QPushButton("Start worker there")
        self.stop_btn = QPushButton("Stop worker")
        self.stop_btn.setToolTip("Stop the selected worker: its running trials stop and are re-queued")
        self.list = QListWidget()
        self.list.setMaximumHeight(44)  # the trials table below needs the height
        self.list.setVisible(False)  # until a worker is started
        self.message = QLabel()
        self.message.setWordWrap(True)
        self.message.setStyleSheet("color: #555;")

        row1 = QHBoxLayout()
        row1.addWidget(QLabel("storage"))
        row1.addWidget(self.storage, 1)
        row2 = QHBoxLayout()  # two rows: the tab's column stays narrow (the sweep is on the window's right)
        row2.addWidget(QLabel("<b>Workers on hosts</b>"))
        row2.addWidget(self.host, 1)
        row2.addWidget(QLabel("devices"))
        row2.addWidget(self.devices, 1)
        row3 = QHBoxLayout()
        row3.addStretch(1)
        row3.addWidget(self.start_btn)
        row3.addWidget(self.stop_btn)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addLayout(row1)
        lay.addLayout(row2)
        lay.addLayout(row3)
        lay.addWidget(self.list)
        lay.addWidget(self.message)

        self.start_btn.clicked.connect(lambda: self.start_worker())
        self.stop_btn.clicked.connect(lambda: self.stop_worker())
        self.list.currentRowChanged.connect(lambda _: self.refresh())
        self.storage.textChanged.connect(lambda _: self._say(""))
        self.sigResult.connect(self._on_result)
        self.timer = QTimer(self)
        self.timer.timeout.connect(self._poll_states)
        self.timer.start(POLL_MS)
        self.refresh()

    # -- what can be done ---------------------------------------------------------------------------
    def hosts(self) -> list[str]:
        """The window's SSH hosts (its host list, less "This computer")."""
        bar = getattr(self.tab.window, "hosts", None)
        if bar is None:
            return []
        return [t for t in (bar.combo.itemText(i) for i in range(bar.combo.count())) if t and t != THIS_COMPUTER]

    def target(self) -> tuple[str, str]:
        """(storage URL, study name) of the tab's sweep; one line (``UserError``) when hosts cannot join it."""
        from multilane.engine.remote.sweep_worker import check_shareable

        sweep = self.tab.sweep
        if sweep is None:
            if self.storage.text().strip():
                check_shareable(self.storage.text())
            raise UserError("start the sweep (or open it) first: workers on hosts join a running study")
        return check_shareable(sweep.storage_url), sweep.spec.name

    def problem(self) -> str | None:
        try:
            self.target()
        except UserError as e:
            return str(e)
        return None if self.hosts() else NO_HOSTS

    def refresh(self) -> None:
        """The host list as the window has it now; the buttons enabled for what can be done."""
        hosts = self.hosts()
        current = self.host.currentText()
        if hosts != [self.host.itemText(i) for i in range(self.host.count())]:
            self.host.blockSignals(True)
            self.host.clear()
            self.host.addItems(hosts)
            self.host.setCurrentIndex(max(0, self.host.findText(current)))
            self.host.blockSignals(False)
        problem = self.problem()
        self.start_btn.setEnabled(problem is None)
        self.start_btn.setToolTip(
            problem or "Start multilane sweep-worker on this host, detached (it outlives the app)"
        )
        entry = self._selected()
        self.stop_btn.setEnabled(entry is not None and entry["state"] == "running")
        self.message.setText(self._said or problem or "")

    def _selected(self) -> dict[str, Any] | None:
        row = self.list.currentRow()
        return self.entries[row] if 0 <= row < len(self.entries) else None

    # -- start, stop, follow ------------------------------------------------------------------------
    def start_worker(self, host: str | None = None, devices: str | None = None) -> bool:
        """Start a worker on ``host`` (default: the picked one) in a thread; False with a line when it cannot."""
        problem = self.problem()
        host = host or self.host.currentText()
        if problem or not host:
            self.message.setText(problem or NO_HOSTS)
            return False
        url, study = self.target()
        devices = (devices if devices is not None else self.devices.text()).strip() or "auto"
        command = self._remote_command(host)
        sweeps_dir = self._setting(f"remote/runs/{host}") or None  # the host's runs folder, if one was named
        self._say(f"starting a worker on {host}…")

        def work() -> None:
            from multilane.engine.remote.connection import Connection, UnknownHostKey
            from multilane.engine.remote.sweep_worker import redact, start_worker

            conn = Connection(host, remote_command=command)
            try:
                w = start_worker(conn.connect(), url, study, devices, sweeps_dir=sweeps_dir)
                self.sigResult.emit("started", {"worker": w, "conn": conn, "state": "running"}, None)
            except UnknownHostKey as e:
                conn.close()
                self.sigResult.emit("error", None, f"{e} (pick {host} in the Setup tab's host list to check it)")
            except UserError as e:
                conn.close()
                self.sigResult.emit("error", None, redact(str(e), url))

        threading.Thread(target=work, name="multilane-sweep-worker-start", daemon=True).start()
        return True

    def stop_worker(self, entry: dict[str, Any] | None = None) -> bool:
        """Stop the selected worker (its running trials stop and are re-queued), in a thread."""
        entry = entry or self._selected()
        if entry is None or entry["state"] != "running":
            return False
        entry["state"] = "stopping"
        self._show()

        def work() -> None:
            from multilane.engine.remote.sweep_worker import stop_worker

            try:
                gone = stop_worker(entry["conn"], entry["worker"].pid)
                self.sigResult.emit("stopped" if gone else "state", entry, None if gone else "running")
            except UserError as e:
                self.sigResult.emit("error", entry, str(e))

        threading.Thread(target=work, name="multilane-sweep-worker-stop", daemon=True).start()
        return True

    def _poll_states(self) -> None:
        running = [e for e in self.entries if e["state"] == "running" and not e.get("polling")]
        if not running:
            return

        def work() -> None:
            from multilane.engine.remote.sweep_worker import worker_running

            for e in running:
                try:
                    alive = worker_running(e["conn"], e["worker"].pid)
                    self.sigResult.emit("state", e, "running" if alive else "ended")
                except UserError:
                    self.sigResult.emit("state", e, "running (no answer)")
                finally:
                    e["polling"] = False

        for e in running:
            e["polling"] = True
        threading.Thread(target=work, name="multilane-sweep-worker-poll", daemon=True).start()

    def _on_result(self, what: str, entry: dict[str, Any] | None, text: str | None) -> None:
        if what == "started" and entry is not None:
            self.entries.append(entry)
            w = entry["worker"]
            self._say(f"worker started on {w.host} (pid {w.pid}); its console log there is in the list's tooltip")
        elif what == "stopped" and entry is not None:
            entry["state"] = "stopped"
            entry["conn"].close()
            self._say(f"worker {entry['worker'].pid} on {entry['worker'].host} stopped; its running trials re-queued")
        elif what == "state" and entry is not None and entry["state"] in ("running", "stopping"):
            if text == "ended":
                entry["state"] = "ended"
                entry["conn"].close()
            elif entry["state"] == "running" or text == "running":
                entry["state"] = "running"
        elif what == "error":
            if entry is not None and entry["state"] == "stopping":
                entry["state"] = "running"
            self._say(text or "the worker could not be started")
        self._show()

    def _show(self) -> None:
        row = self.list.currentRow()
        self.list.clear()
        for e in self.entries:
            w = e["worker"]
            self.list.addItem(f"{w.host} · {w.devices} · pid {w.pid} · {e['state']}")
            self.list.item(self.list.count() - 1).setToolTip(f"console log on {w.host}: {w.log}")
        self.list.setVisible(bool(self.entries))
        if self.entries:
            self.list.setCurrentRow(row if 0 <= row < len(self.entries) else len(self.entries) - 1)
        self.refresh()

    def _say(self, text: str) -> None:
        self._said = text  # what the last start or stop said stays until the next one (or a new storage)
        self.refresh()

    def _remote_command(self, host: str) -> str:
        return self._setting(f"remote/command/{host}") or "multilane"

    def _setting(self, key: str) -> str:
        """What the Setup tab's host bar remembers for a host (its command, its runs folder there)."""
        bar = getattr(self.tab.window, "hosts", None)
        return str((bar.settings.value(key, "") if bar is not None else "") or "").strip()

    def close_connections(self) -> None:
        for e in self.entries:
            e["conn"].close()
