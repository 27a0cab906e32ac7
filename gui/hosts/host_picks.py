"""Devices picked on several hosts make one ddp run across them.

The device list shows one place at a time (the host bar). What it shows checked on a host when the user
switches to another place is remembered as that host's picks, and comes back with the host; the host
on screen counts with what it shows. When two or
more hosts hold picks, a line under the list says so ("one ddp run across A (2 devices) and B (1
device)"), and Start launches that run: a launcher on each host, strategy ddp (forced, the line says
it), the rendezvous and the run folder on the first host picked, followed through its mirror like a
run on one host. "Only this host" forgets the other hosts' picks. This computer takes no part: the
hosts would have to reach it, and it is not a server.
"""

from __future__ import annotations

import json
from typing import Any

from multilane.engine.remote.multi_host import node_counts
from multilane.gui.runs.multi_host_follow import MultiHostFollowWorker
from PySide6.QtCore import QObject, Signal
from PySide6.QtWidgets import QHBoxLayout, QLabel, QPushButton, QWidget


class HostPicks(QObject):
    """The picks of every host the user checked devices on; ``widget`` is the line under the list."""

    changed = Signal()

    def __init__(self, hosts: Any, devices: Any, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.hosts, self.devices = hosts, devices
        self.picks: dict[str, list[str]] = {}  # host -> device names the user checked there, in pick order
        self.widget = QWidget()
        row = QHBoxLayout(self.widget)
        row.setContentsMargins(0, 0, 0, 0)
        self.line = QLabel()
        self.line.setObjectName("host_picks")
        self.line.setWordWrap(True)
        self.line.setStyleSheet("color: #1f5fa8;")
        self.only_here = QPushButton("Only this host")
        self.only_here.setToolTip("Forget the devices picked on the other hosts: the run goes on this host alone")
        row.addWidget(self.line, 1)
        row.addWidget(self.only_here)
        self.widget.setVisible(False)
        devices.tree.itemChanged.connect(self._user_picked)  # the user's clicks (refills block the tree's signals)
        # before the window empties the list for the next host (its handler is connected after this one)
        hosts.hostChanged.connect(self._leaving)
        self._list_seen = devices.items  # a new list object: the picker was refilled (show_host)
        devices.changed.connect(self._devices_changed)
        self.only_here.clicked.connect(self.clear_others)

    # -- the picks ---------------------------------------------------------------------------------
    def _user_picked(self, *_: Any) -> None:
        host = self.devices.host
        if host is None or host != self.hosts.host:
            return
        self._remember(host)
        self._update()

    def _leaving(self, *_: Any) -> None:
        """Another place is picked: what the list shows for the host it leaves is that host's picks."""
        old = self.devices.host
        if old is not None:
            self._remember(old)
        self._update()

    def _remember(self, host: str) -> None:
        """What the list shows checked now is ``host``'s picks (none checked: it has none)."""
        names = [d.name for d in self.devices.selected()]
        if names:
            self.picks[host] = names
        else:
            self.picks.pop(host, None)

    def _devices_changed(self, *_: Any) -> None:
        """The picker changed; when it was just refilled with a host's list, that host's picks come back."""
        if self.devices.items is not self._list_seen:
            self._list_seen = self.devices.items
            host = self.devices.host
            if host is not None and host == self.hosts.host and host in self.picks:
                self.devices.set_checked(self.picks[host])  # emits changed again: the list is the same one
                return
        self._update()

    def clear_others(self) -> None:
        here = self.hosts.host
        self.picks = {h: p for h, p in self.picks.items() if h == here}
        self._update()

    def across(self) -> list[tuple[str, str]]:
        """``[(host, "dev,dev"), ...]`` when the picks span two or more hosts (the first: rendezvous and
        run folder), else ``[]``. The host on screen counts with what it shows."""
        here = self.hosts.host
        if here is None or self.devices.host != here:
            return []
        order = list(self.picks)
        if here not in order:
            order.append(here)
        shown = [d.name for d in self.devices.selected()]
        out = []
        for host in order:
            names = shown if host == here else self.picks[host]
            if names:
                out.append((host, ",".join(names)))
        return out if len(out) > 1 else []

    def _update(self, *_: Any) -> None:
        pairs = self.across()
        self.widget.setVisible(bool(pairs))
        if pairs:
            self.line.setText(
                f"One ddp run across {node_counts(pairs)} (strategy ddp; rendezvous and run folder on {pairs[0][0]})"
            )
        self.changed.emit()

    # -- Start -------------------------------------------------------------------------------------
    def start(self, window: Any, config: Any) -> bool:
        """Start the run across the picked hosts; the window follows host 0's run folder."""
        pairs = self.across()
        settings = window.settings
        nodes = []
        for host, devices in pairs:
            if host == self.hosts.host:  # as typed in the host bar, saved or not
                command, runs = self.hosts.remote_command, self.hosts.remote_runs
            else:
                command = str(settings.value(f"remote/command/{host}", "") or "") or "multilane"
                runs = str(settings.value(f"remote/runs/{host}", "") or "") or None
            nodes.append((host, devices, command, runs))
        data = config.to_dict()
        data["devices"] = {**data["devices"], "use": pairs[0][1], "strategy": "ddp", "weights": []}
        worker = MultiHostFollowWorker(nodes, window._runs_dir(), data)
        window._begin_remote(worker, config)
        window.status_label.setText(f"Starting one ddp run across {node_counts(pairs)}…")
        settings.setValue("last_config", json.dumps(config.to_dict()))  # as a local Start does
        return True
