"""Run > Resume on a host: the host's run folders listed (over SFTP, in a thread of their own; newest
first, with their state and step), and the chosen one resumed there from its last checkpoint, then
followed through its mirror like a run started there.

As a local resume, it continues the run with the settings it was started with (the form's values are
not applied; the curves so far are shown, then the new steps). A run still live there is refused in
one line (``engine/remote/remote_runs.py``); the list marks it and keeps Resume off for it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from multilane.engine.errors import UserError
from multilane.gui.runs.remote_follow import RemoteFollowWorker
from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QDialog,
    QDialogButtonBox,
    QHeaderView,
    QLabel,
    QTreeWidget,
    QTreeWidgetItem,
    QVBoxLayout,
    QWidget,
)

COLUMNS = ["Run", "State", "Step", "Checkpoint", "Updated"]


class RemoteRunsDialog(QDialog):
    """The run folders of ``host``'s runs folder; ``chosen`` gives the one to resume (its path there)."""

    listed = Signal(object, object)  # the rows (RemoteRunRow) or None, an error (str) or None
    chosen = Signal(str)

    def __init__(
        self,
        parent: QWidget,
        host: str,
        remote_command: str,
        runs_dir: str | None,
        ask: Callable[[str], str | None] | None = None,
    ) -> None:
        super().__init__(parent)
        self.setObjectName("remote_resume")
        self.setWindowTitle(f"Resume a run on {host}")
        self.resize(820, 380)
        self.host = host
        self.rows: list[Any] | None = None
        self.where = runs_dir or "runs"
        layout = QVBoxLayout(self)
        self.message = QLabel(f"reading the runs on {host}…")
        self.message.setWordWrap(True)
        layout.addWidget(self.message)
        self.tree = QTreeWidget()
        self.tree.setHeaderLabels(COLUMNS)
        self.tree.setRootIsDecorated(False)
        header = self.tree.header()
        header.setStretchLastSection(False)
        header.setSectionResizeMode(0, QHeaderView.Stretch)  # the run's name takes what the others leave
        for c in range(1, len(COLUMNS)):
            header.setSectionResizeMode(c, QHeaderView.ResizeToContents)
        layout.addWidget(self.tree, 1)
        self.buttons = QDialogButtonBox()
        self.resume_btn = self.buttons.addButton("Resume there", QDialogButtonBox.AcceptRole)
        self.resume_btn.setEnabled(False)
        self.buttons.addButton(QDialogButtonBox.Cancel)
        layout.addWidget(self.buttons)
        self.buttons.accepted.connect(self._resume)
        self.buttons.rejected.connect(self.reject)
        self.tree.currentItemChanged.connect(self._selected)
        self.tree.itemDoubleClicked.connect(lambda *_: self.resume_btn.isEnabled() and self._resume())
        self.listed.connect(self._show)
        threading.Thread(
            target=self._read, args=(remote_command, runs_dir, ask), name="multilane-remote-runs", daemon=True
        ).start()

    def _read(self, remote_command: str, runs_dir: str | None, ask: Any) -> None:
        from multilane.engine.remote.connection import Connection
        from multilane.engine.remote.remote_runs import list_runs, runs_folder_there
        from multilane.gui.hosts.secrets import attempt_done

        try:
            conn = Connection(self.host, remote_command=remote_command, ask=ask)
            try:
                conn.connect()
            except UserError:
                attempt_done(ask, False)
                raise
            attempt_done(ask, True)
            with conn:
                runs = runs_folder_there(conn, runs_dir)
                rows = list_runs(conn, runs) if runs is not None else []
            self.where = runs or runs_dir or "runs"
            self.listed.emit(rows, None)
        except UserError as e:
            self.listed.emit(None, str(e))

    def _show(self, rows: list[Any] | None, error: str | None) -> None:
        self.rows = rows
        if error is not None:
            self.message.setText(error)
            self.message.setStyleSheet("color: #d62728;")
            return
        where = f"{self.host}:{self.where}"
        self.message.setText(f"{len(rows)} run folders in {where}, newest first" if rows else f"no runs in {where}")
        for r in rows:
            state = r.state or "?"
            if r.live:
                state += f" (live, pid {r.live_pid})"
            step = "" if r.step is None else f"{r.step}" + (f" / {r.total_steps}" if r.total_steps else "")
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(r.mtime)) if r.mtime else ""
            item = QTreeWidgetItem([r.name, state, step, "yes" if r.checkpoint else "no", when])
            item.setData(0, Qt.UserRole, r)
            item.setToolTip(0, r.path)
            self.tree.addTopLevelItem(item)
        if rows:
            self.tree.setCurrentItem(self.tree.topLevelItem(0))

    def _selected(self, item: QTreeWidgetItem | None, *_: Any) -> None:
        r = item.data(0, Qt.UserRole) if item is not None else None
        ok = r is not None and r.checkpoint and not r.live
        self.resume_btn.setEnabled(bool(ok))
        if r is not None and r.live:
            self.message.setText(f"{r.name} is still training there (pid {r.live_pid}): it cannot be resumed")
        elif r is not None and not r.checkpoint:
            self.message.setText(f"{r.name} has no checkpoint to resume from")
        elif r is not None:
            self.message.setText(f"resume {r.path} on {self.host}")

    def _resume(self) -> None:
        item = self.tree.currentItem()
        r = item.data(0, Qt.UserRole) if item is not None else None
        if r is not None:
            self.accept()
            self.chosen.emit(r.path)


class RemoteResumeMixin:
    """Part of ``MainWindow``: Resume from run folder, when a host is picked, resumes a run there."""

    def remote_resume_dialog(self) -> RemoteRunsDialog | None:
        host = self.hosts.host
        if host is None or self.is_running():
            return None
        box = RemoteRunsDialog(
            self, host, self.hosts.remote_command, self.hosts.remote_runs, self.hosts.secrets.asker(host)
        )
        box.chosen.connect(self.resume_remote)
        self.remote_resume_box = box
        box.open()
        return box

    def resume_remote(self, path: str) -> bool:
        """Resume the run in the picked host's folder ``path`` there, and follow it through its mirror."""
        host = self.hosts.host
        if host is None or self.is_running():
            return False
        worker = RemoteFollowWorker(
            host, self._runs_dir(), self.hosts.remote_command, resume=path, ask=self.hosts.secrets.asker(host)
        )
        self._resume_from = None
        self._begin_remote(worker, None)
        return True

    def _resume_action_text(self, host: str | None) -> None:
        self.resume_action.setText(f"Resume a run on {host}…" if host else "Resume from run folder…")
