"""Where to train: "This computer" or an SSH host (every ``Host`` alias of ``~/.ssh/config``, plus the
``[user@]host[:port]`` the user added, remembered), and the window's remote runs: Start there, follow
through the mirror, and at launch the offer to follow remote runs still training.

Picking a host reads its devices (``multilane devices --json`` over SSH) in a thread of its own; an
unknown host key is asked about (its fingerprint shown) before anything is trusted.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from multilane.engine.display.terminal_text import printable
from multilane.engine.errors import UserError
from multilane.gui.hosts.secrets import HostSecrets, attempt_done
from multilane.gui.runs.remote_follow import RemoteFollowWorker, unfinished_mirrors
from multilane.gui.runs.worker import RunHandle
from PySide6.QtCore import QSettings, Signal
from PySide6.QtWidgets import (
    QComboBox,
    QHBoxLayout,
    QInputDialog,
    QLabel,
    QLineEdit,
    QMessageBox,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

THIS_COMPUTER = "This computer"
HOSTS_KEY = "remote/hosts"  # the hosts the user added, as a JSON list


class HostBar(QWidget):
    """The host picker above the device list."""

    hostChanged = Signal(object)  # the host (str), or None for this computer
    devicesRead = Signal(object, object, object)  # host, the rows or None, an error (str) or None
    untrusted = Signal(object, object, object)  # host, fingerprint, message

    def __init__(self, settings: QSettings, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.settings = settings
        self.secrets = HostSecrets(self)  # passwords and passphrases: asked here, kept in memory only
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        row = QHBoxLayout()
        self.combo = QComboBox()
        self.combo.setObjectName("host")
        self.combo.setToolTip("Train on this computer, or on a host over SSH (your ~/.ssh/config, keys and agent)")
        self.add_btn = QPushButton("Add host…")
        self.add_btn.setToolTip("Add a host as [user@]host[:port]; it is remembered")
        row.addWidget(QLabel("on"))
        row.addWidget(self.combo, 1)
        row.addWidget(self.add_btn)
        layout.addLayout(row)
        self.command = QLineEdit()
        self.command.setObjectName("remote_command")
        self.command.setPlaceholderText("multilane")
        self.command.setToolTip("multilane's command on this host (default: multilane on its login PATH)")
        self.command_row = QWidget()
        cr = QHBoxLayout(self.command_row)
        cr.setContentsMargins(0, 0, 0, 0)
        cr.addWidget(QLabel("command there"))
        cr.addWidget(self.command, 1)
        self.runs = QLineEdit()
        self.runs.setObjectName("remote_runs_dir")
        self.runs.setPlaceholderText("runs")
        self.runs.setToolTip("The host's runs folder (default: runs, in your home there)")
        cr.addWidget(QLabel("runs there"))
        cr.addWidget(self.runs, 1)
        layout.addWidget(self.command_row)
        self.message = QLabel()
        self.message.setWordWrap(True)
        layout.addWidget(self.message)
        self.reload()
        self.combo.currentIndexChanged.connect(self._picked)
        self.add_btn.clicked.connect(self._add_dialog)
        self.command.editingFinished.connect(self._save_command)
        self.runs.editingFinished.connect(self._save_command)
        self.untrusted.connect(self._ask_trust)
        self.trust_box: QMessageBox | None = None
        self._picked()

    # -- the list ----------------------------------------------------------------------------------
    def added_hosts(self) -> list[str]:
        try:
            hosts = json.loads(self.settings.value(HOSTS_KEY, "[]") or "[]")
        except (TypeError, ValueError):
            return []
        return [h for h in hosts if isinstance(h, str)]

    def reload(self) -> None:
        from multilane.engine.remote.hosts import config_hosts

        current = self.combo.currentText()
        self.combo.blockSignals(True)
        self.combo.clear()
        self.combo.addItem(THIS_COMPUTER)
        for h in [*config_hosts(), *self.added_hosts()]:
            if self.combo.findText(h) < 0:
                self.combo.addItem(h)
        self.combo.setCurrentIndex(max(0, self.combo.findText(current)))
        self.combo.blockSignals(False)

    def add_host(self, text: str) -> str:
        """Add ``[user@]host[:port]`` (remembered) and pick it; ``UserError`` for one that is not a host."""
        from multilane.engine.remote.hosts import HostSpec

        host = str(HostSpec.parse(text))
        if host not in self.added_hosts():
            self.settings.setValue(HOSTS_KEY, json.dumps([*self.added_hosts(), host]))
        self.reload()
        self.combo.setCurrentText(host)
        return host

    def _add_dialog(self) -> None:
        text, ok = QInputDialog.getText(self, "Add host", "SSH host ([user@]host[:port] or an ssh config alias):")
        if ok and text.strip():
            try:
                self.add_host(text)
            except UserError as e:
                self.message.setText(str(e))

    @property
    def host(self) -> str | None:
        text = self.combo.currentText()
        return None if text == THIS_COMPUTER or not text else text

    @property
    def remote_command(self) -> str:
        return self.command.text().strip() or "multilane"

    @property
    def remote_runs(self) -> str | None:
        return self.runs.text().strip() or None

    def _save_command(self) -> None:
        if self.host is not None:
            self.settings.setValue(f"remote/command/{self.host}", self.command.text().strip())
            self.settings.setValue(f"remote/runs/{self.host}", self.runs.text().strip())

    # -- picking one -------------------------------------------------------------------------------
    def _picked(self, *_: Any) -> None:
        host = self.host
        self.command_row.setVisible(host is not None)
        self.command.setText(str(self.settings.value(f"remote/command/{host}", "") or "") if host else "")
        self.runs.setText(str(self.settings.value(f"remote/runs/{host}", "") or "") if host else "")
        self.message.setText(f"reading the devices of {host}…" if host else "")
        self.hostChanged.emit(host)
        if host is not None:
            self.read_devices(host)

    def read_devices(self, host: str, trust: str | None = None) -> None:
        """``multilane devices --json`` on ``host``, in a thread; ``devicesRead`` or ``untrusted`` comes back."""
        command = self.remote_command
        ask = self.secrets.asker(host)

        def work() -> None:
            from multilane.engine.remote.connection import Connection, UnknownHostKey

            try:
                try:
                    conn = Connection(host, remote_command=command, trust=trust, ask=ask).connect()
                except UserError:
                    attempt_done(ask, False)
                    raise
                attempt_done(ask, True)
                from multilane.engine.remote.devices_answer import read_devices

                with conn:
                    rows = read_devices(conn)  # checked: a wrong answer is one line naming the host
                self.devicesRead.emit(host, rows, None)
            except UnknownHostKey as e:
                self.untrusted.emit(host, e.fingerprint, str(e))
            except (UserError, ValueError) as e:
                self.devicesRead.emit(host, None, str(e))

        threading.Thread(target=work, name="multilane-host-devices", daemon=True).start()

    def _ask_trust(self, host: str, fingerprint: str, message: str) -> None:
        box = QMessageBox(QMessageBox.Question, "Unknown host key", "", parent=self)
        box.setText(
            f"{host} offers a host key that is not in your known_hosts:\n\n{fingerprint}\n\n"
            "Trust it only if this is the fingerprint the host's owner gives you. Trust it and connect?"
        )
        trust = box.addButton("Trust and connect", QMessageBox.AcceptRole)
        box.addButton(QMessageBox.Cancel)
        box.setDefaultButton(QMessageBox.Cancel)  # never trusted by a stray Enter
        box.buttonClicked.connect(
            lambda b: self.read_devices(host, fingerprint) if b is trust else self.devicesRead.emit(host, None, message)
        )
        self.trust_box = box
        box.open()


class RemoteRunsMixin:
    """Part of ``MainWindow``: its runs on hosts (attributes: hosts, devices, status_label, _begin...)."""

    def _host_devices(self, host: str, rows: list | None, error: str | None) -> None:
        if host != self.hosts.host:
            return  # another host was picked meanwhile
        if error is not None:
            self.hosts.message.setText(printable(error))
            self.hosts.message.setStyleSheet("color: #d62728;")
            self.devices.show_host(host, [])
            self.devices.set_checked([])  # nothing from a host that did not answer: Start stays off
            return
        self.hosts.message.setStyleSheet("")
        self.hosts.message.setText(f"devices of {host}")
        self.devices.show_host(host, rows)

    def _host_changed(self, host: str | None) -> None:
        if host is None:
            self.devices.show_host(None)
        else:
            self.devices.set_checked([])  # until the host's own list arrives

    def start_remote(self, config: Any) -> bool:
        """Start the run on the picked host; the window follows it through its mirror."""
        if self.host_picks.across():  # devices picked on several hosts: one ddp run across them
            return self.host_picks.start(self, config)
        worker = RemoteFollowWorker(
            self.hosts.host,
            self._runs_dir(),
            self.hosts.remote_command,
            config=config.to_dict(),
            remote_runs=self.hosts.remote_runs,
            ask=self.hosts.secrets.asker(self.hosts.host),
        )
        self._begin_remote(worker, config)
        self.settings.setValue("last_config", json.dumps(config.to_dict()))  # as a local Start does
        return True

    def follow_remote(self, mirror: str | Path) -> bool:
        """Follow again a run on a host, through its mirror folder (found by ``offer_remote_runs``)."""
        from multilane.engine.remote.mirror import read_remote_json

        if self.is_running():
            return False
        info = read_remote_json(mirror) or {}
        host = info.get("host", "")
        worker = RemoteFollowWorker(
            host,
            Path(mirror).parent,
            info.get("remote_command") or "multilane",
            mirror=mirror,
            ask=self.hosts.secrets.asker(host),
        )
        self._resume_from = None
        self._begin_remote(worker, None)
        return True

    def _begin_remote(self, worker: RemoteFollowWorker, config: Any) -> None:
        worker.connection.connect(self._on_connection)
        self._begin(RunHandle(worker), config)
        self.status_label.setText(f"Connecting to {worker.host}…")

    def _on_connection(self, text: str | None) -> None:
        self.status_label.setText(printable(text) if text else "Following")  # back after "reconnecting…" or a catch-up

    def offer_remote_runs(self) -> list[Path]:
        """Remote runs still training when last seen: offer to follow the newest (a non-modal question)."""
        mirrors = unfinished_mirrors(self._runs_dir())
        if not mirrors or self.is_running():
            return mirrors
        newest = mirrors[-1]
        box = QMessageBox(QMessageBox.Question, "Runs still training on hosts", "", parent=self)
        names = "\n".join(f"• {m.name}" for m in mirrors)
        box.setText(
            f"These runs were training on a host when the window last followed them:\n{names}\n\nFollow {newest.name}?"
        )
        follow = box.addButton("Follow", QMessageBox.AcceptRole)
        box.addButton("Not now", QMessageBox.RejectRole)
        box.buttonClicked.connect(lambda b: self.follow_remote(newest) if b is follow else None)
        self.remote_offer = box
        box.open()
        return mirrors
