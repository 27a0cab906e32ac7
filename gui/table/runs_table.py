"""The runs table: the runs of the runs folder, to find (search, status filter, sort on any column),
open, compare, tag and annotate, rename, and delete to the trash (with undo). It refreshes by itself
while shown, as runs start and end (a cheap stamp of the folder every 2 s; only changed runs are re-read)."""

from __future__ import annotations

from pathlib import Path

from multilane.engine.errors import UserError
from multilane.engine.rundir.follow import DIVERGED
from multilane.engine.rundir.runs_folder import parse_tags, rename_run, restore_run, trash_run, write_meta
from multilane.gui.table.cells import run_cell
from multilane.gui.table.mlflow_send import MlflowSend
from multilane.gui.table.runs_index import COLUMNS, MAIN_COLUMNS, RunSummary, list_runs, lm_columns, runs_signature
from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QKeySequence, QShortcut
from PySide6.QtWidgets import (
    QAbstractItemView,
    QComboBox,
    QHBoxLayout,
    QHeaderView,
    QInputDialog,
    QLabel,
    QLineEdit,
    QMenu,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

EDITABLE = ("tags", "note")  # edited in place (double-click, F2); written to the run's meta.json
STATES = ["all", "starting", "running", "paused", "finished", "stopped", DIVERGED, "failed"]
POLL_MS = 2000


TASK_COLUMN_PX = 220  # the task column at most this wide; a longer task file path is elided in the middle
NAME_COLUMN_PX = 140  # the run's name at least this wide where the table is narrow (elided in the middle, its
# tooltip whole); wider, up to its longest name, where the other shown columns leave room
HEADER_TIPS = {"final_loss": "The last logged training loss", "best_val_loss": "The best validation loss"}


class RunsTable(QWidget):
    """Runs in a folder with their status, key hyperparameters, final and best metrics, training time,
    tags and note."""

    openRequested = Signal(str)
    compareRequested = Signal(list)  # run folders: the first is shown, the others compared with it

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.runs_dir = ""
        self.rows: list[RunSummary] = []
        self._cache: dict = {}
        self._signature: tuple = ()
        self._loading = False
        self.undo_stack: list[list[tuple[str, str]]] = []  # per delete: (where it went, where it was)
        self.folder = QLabel()
        self.folder.setWordWrap(True)
        self.search = QLineEdit()
        self.search.setObjectName("runs.search")
        self.search.setPlaceholderText("Search: name, task, tags, note…")
        self.search.setToolTip("Shows the runs in which every word typed appears in some column")
        self.search.setClearButtonEnabled(True)
        self.search.textChanged.connect(self._apply_filter)
        self.state = QComboBox()
        self.state.setObjectName("runs.state")
        self.state.addItems(STATES)
        self.state.setToolTip("Show only runs in this state")
        self.state.currentTextChanged.connect(self._apply_filter)
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels([title for _, title in COLUMNS])
        self.table.setSelectionBehavior(QAbstractItemView.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.ExtendedSelection)
        self.table.setEditTriggers(QAbstractItemView.DoubleClicked | QAbstractItemView.EditKeyPressed)
        self.table.setSortingEnabled(True)
        self.table.verticalHeader().setVisible(False)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeToContents)
        # a task file's long path is elided in the middle ("/home/…/my_task.py", the whole path in its
        # tooltip): it widened the table until lr and loss needed scrolling
        self.table.setTextElideMode(Qt.ElideMiddle)
        self.table.setWordWrap(False)  # one line a run: a wrapped path was cut at its end, not elided
        self._task_col = COLUMNS.index(("task", "task"))
        self._capped = {self._task_col: TASK_COLUMN_PX}  # widest contents, up to a cap
        for c in (*self._capped, 0):
            self.table.horizontalHeader().setSectionResizeMode(c, QHeaderView.Interactive)
        for c, (key, _) in enumerate(COLUMNS):
            if key in HEADER_TIPS:
                self.table.horizontalHeaderItem(c).setToolTip(HEADER_TIPS[key])
        header = self.table.horizontalHeader()
        header.setToolTip("Click a column to sort by it, again to reverse; right-click to show or hide columns")
        header.setContextMenuPolicy(Qt.CustomContextMenu)
        header.customContextMenuRequested.connect(self._columns_menu)
        self.set_hidden_columns([key for key, _ in COLUMNS if key not in MAIN_COLUMNS])
        self.table.doubleClicked.connect(self._double_clicked)
        self.table.itemChanged.connect(self._item_changed)
        self.open_btn = QPushButton("Open")
        self.compare_btn = QPushButton("Compare selected")
        self.compare_btn.setToolTip("Select two or more runs (Ctrl+click); the first selected is shown")
        self.rename_btn = QPushButton("Rename…")
        self.delete_btn = QPushButton("Delete")
        self.delete_btn.setToolTip(
            "Move the selected runs to the trash (.trash in the runs folder); Undo brings them back"
        )
        self.undo_btn = QPushButton("Undo delete")
        self.undo_btn.setObjectName("runs.undo")
        self.undo_btn.setShortcut(QKeySequence.Undo)
        refresh = QPushButton("Refresh")
        self.open_btn.clicked.connect(self._open)
        self.compare_btn.clicked.connect(self._compare)
        self.rename_btn.clicked.connect(self._rename_dialog)
        self.delete_btn.clicked.connect(lambda: self.delete(self.selected_paths()))
        self.undo_btn.clicked.connect(self.undo_delete)
        refresh.clicked.connect(lambda: self.load(self.runs_dir))
        QShortcut(QKeySequence.Delete, self.table, activated=lambda: self.delete(self.selected_paths()))
        self.table.itemSelectionChanged.connect(self._selection_changed)
        find = QHBoxLayout()
        find.addWidget(self.search, 1)
        find.addWidget(self.state)
        buttons = QHBoxLayout()  # two rows: one would make the left side too wide for a 1024-px screen
        for b in (self.open_btn, self.compare_btn, refresh):
            buttons.addWidget(b)
        edits = QHBoxLayout()
        self.mlflow = MlflowSend(self)  # "Send to MLflow…": the selected runs to a tracking server
        for b in (self.rename_btn, self.delete_btn, self.undo_btn, self.mlflow.button):
            edits.addWidget(b)
        self.message = QLabel()
        self.message.setObjectName("runs.message")
        self.message.setWordWrap(True)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.folder)
        layout.addLayout(find)
        layout.addWidget(self.table, 1)
        layout.addWidget(self.message)
        layout.addLayout(buttons)
        layout.addLayout(edits)
        self.poll = QTimer(self)
        self.poll.setInterval(POLL_MS)
        self.poll.timeout.connect(self._poll)
        self._selection_changed()

    # -- columns ---------------------------------------------------------------------------------
    def hidden_columns(self) -> list[str]:
        """The keys of the columns hidden now (the app remembers them)."""
        return [key for c, (key, _) in enumerate(COLUMNS) if self.table.isColumnHidden(c)]

    def set_hidden_columns(self, keys: list[str]) -> None:
        """Hide these columns and show the others (the run's name always shows)."""
        for c, (key, _) in enumerate(COLUMNS):
            self.table.setColumnHidden(c, key in keys and key != "name")

    def _fit_name_column(self) -> None:
        """The run's name as wide as its longest, or as the room the other shown columns leave (at least
        ``NAME_COLUMN_PX``): the columns that decide a comparison stay in view without scrolling."""
        self.table.resizeColumnToContents(0)
        others = sum(self.table.columnWidth(c) for c in range(1, len(COLUMNS)) if not self.table.isColumnHidden(c))
        room = self.table.viewport().width() - others - 2
        self.table.setColumnWidth(0, min(self.table.columnWidth(0), max(NAME_COLUMN_PX, room)))

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self._fit_name_column()

    def _columns_menu(self, pos) -> None:
        menu = QMenu(self)
        for c, (key, title) in enumerate(COLUMNS):
            action = menu.addAction(title)
            action.setCheckable(True)
            action.setChecked(not self.table.isColumnHidden(c))
            action.setEnabled(key != "name")
            action.toggled.connect(lambda on, c=c: (self.table.setColumnHidden(c, not on), self._fit_name_column()))
        menu.exec(self.table.horizontalHeader().mapToGlobal(pos))

    # -- loading and refreshing ------------------------------------------------------------------
    def load(self, runs_dir: str) -> None:
        """(Re)read the run folders under ``runs_dir``; the selection, sort and filter stay."""
        if runs_dir != self.runs_dir:
            self._cache.clear()
        self.runs_dir = runs_dir
        self._signature = runs_signature(runs_dir)
        selected = set(self.selected_paths())
        self.rows = list_runs(runs_dir, self._cache)
        self.folder.setText(f"{len(self.rows)} runs in {runs_dir}" if self.rows else f"No runs in {runs_dir} yet")
        self._loading = True
        self.table.setSortingEnabled(False)
        self.table.clearContents()
        self.table.setRowCount(len(self.rows))
        for r, row in enumerate(self.rows):
            for c, (key, _) in enumerate(COLUMNS):
                item = run_cell(row, key)
                item.setData(Qt.UserRole, str(row.path))
                flags = item.flags() | Qt.ItemIsEditable if key in EDITABLE else item.flags() & ~Qt.ItemIsEditable
                item.setFlags(flags)
                if key in EDITABLE:
                    item.setToolTip(f"Double-click to edit this run's {key} (kept in its meta.json)")
                elif key in ("task", "name"):  # the whole path or name of an elided one
                    item.setToolTip(item.text() + (f" ({'; '.join(row.notes)})" if row.notes else ""))
                elif row.notes:
                    item.setToolTip("; ".join(row.notes))
                self.table.setItem(r, c, item)
        for c, cap in self._capped.items():
            self.table.resizeColumnToContents(c)
            self.table.setColumnWidth(c, min(self.table.columnWidth(c), cap))
        self._lm, hidden = lm_columns(self.rows, self.hidden_columns(), getattr(self, "_lm", False))
        self.set_hidden_columns(hidden)
        self._fit_name_column()
        self.table.setSortingEnabled(True)
        self._loading = False
        self._apply_filter()
        if selected:
            self.select(sorted(selected))
        self._selection_changed()

    def _poll(self) -> None:
        editing = self.table.state() == QAbstractItemView.EditingState  # a reload would end the edit
        if self.runs_dir and self.isVisible() and not editing and runs_signature(self.runs_dir) != self._signature:
            self.load(self.runs_dir)

    def showEvent(self, event) -> None:
        super().showEvent(event)
        self.poll.start()

    def hideEvent(self, event) -> None:
        super().hideEvent(event)
        self.poll.stop()

    # -- finding ---------------------------------------------------------------------------------
    def _apply_filter(self) -> None:
        words = self.search.text().lower().split()
        state = self.state.currentText()
        status_col = COLUMNS.index(("status", "status"))
        for r in range(self.table.rowCount()):
            text = " ".join(
                (self.table.item(r, c).text() if self.table.item(r, c) else "") for c in range(len(COLUMNS))
            )
            status = self.table.item(r, status_col).text() if self.table.item(r, status_col) else ""
            show = all(w in text.lower() for w in words) and (state == "all" or status == state)
            self.table.setRowHidden(r, not show)

    def visible_paths(self) -> list[str]:
        """The run folders shown now, top to bottom (after the filter and the sort)."""
        return [
            self.table.item(r, 0).data(Qt.UserRole)
            for r in range(self.table.rowCount())
            if not self.table.isRowHidden(r)
        ]

    # -- tags, note, rename, delete --------------------------------------------------------------
    def _item_changed(self, item: QTableWidgetItem) -> None:
        key = COLUMNS[item.column()][0]
        if self._loading or key not in EDITABLE:
            return
        path = item.data(Qt.UserRole)
        text = item.text()
        self.set_meta(path, **({"tags": parse_tags(text)} if key == "tags" else {"note": text.strip()}))

    def set_meta(self, path: str, tags: list[str] | None = None, note: str | None = None) -> bool:
        """Write a run's tags and/or note; the table shows them at once."""
        try:
            write_meta(path, tags=tags, note=note)
        except UserError as e:
            self.say(str(e), error=True)
            return False
        self.load(self.runs_dir)
        return True

    def rename(self, path: str, new_name: str) -> str | None:
        """Rename a run's folder; the new path, or None (said in the table) when it cannot be renamed."""
        try:
            new = rename_run(path, new_name)
        except UserError as e:
            self.say(str(e), error=True)
            return None
        self.say(f"Renamed {Path(path).name} to {new.name}")
        self.load(self.runs_dir)
        return str(new)

    def _rename_dialog(self) -> None:
        paths = self.selected_paths()
        if len(paths) != 1:
            return
        name, ok = QInputDialog.getText(self, "Rename run", "New name of the run folder:", text=Path(paths[0]).name)
        if ok and name.strip():
            self.rename(paths[0], name)

    def delete(self, paths: list[str]) -> int:
        """Move runs to the trash (refused for a run that is still being written); Undo brings them back."""
        moved, problems = [], []
        for p in paths:
            try:
                moved.append((str(trash_run(p)), p))
            except UserError as e:
                problems.append(str(e))
        if moved:
            self.undo_stack.append(moved)
            self.say(
                f"Moved {len(moved)} run{'s' if len(moved) != 1 else ''} to the trash ({Path(moved[0][0]).parent})"
                + (f"; {problems[0]}" if problems else ""),
                error=bool(problems),
            )
        elif problems:
            self.say(problems[0], error=True)
        self.load(self.runs_dir)
        return len(moved)

    def undo_delete(self) -> int:
        """Bring back the runs of the last delete."""
        if not self.undo_stack:
            return 0
        batch = self.undo_stack.pop()
        back = 0
        for trashed, original in batch:
            try:
                restore_run(trashed, original)
                back += 1
            except UserError as e:
                self.say(str(e), error=True)
        if back:
            self.say(f"Restored {back} run{'s' if back != 1 else ''} from the trash")
        self.load(self.runs_dir)
        return back

    def say(self, text: str, error: bool = False) -> None:
        self.message.setText(text)
        self.message.setStyleSheet("color: #d62728;" if error else "")

    # -- selection -------------------------------------------------------------------------------
    def selected_paths(self) -> list[str]:
        rows = sorted({i.row() for i in self.table.selectedIndexes()})
        return [self.table.item(r, 0).data(Qt.UserRole) for r in rows if self.table.item(r, 0)]

    def select(self, paths: list[str]) -> None:
        """Select the rows of these run folders (as a user's Ctrl+click would)."""
        self.table.clearSelection()
        wanted = {str(Path(p)) for p in paths}
        mode = self.table.selectionMode()
        self.table.setSelectionMode(QAbstractItemView.MultiSelection)
        for r in range(self.table.rowCount()):
            if self.table.item(r, 0).data(Qt.UserRole) in wanted:
                self.table.selectRow(r)
        self.table.setSelectionMode(mode)

    def _selection_changed(self) -> None:
        n = len(self.selected_paths())
        self.open_btn.setEnabled(n == 1)
        self.rename_btn.setEnabled(n == 1)
        self.delete_btn.setEnabled(n >= 1)
        self.compare_btn.setEnabled(n >= 2)
        self.undo_btn.setEnabled(bool(self.undo_stack))

    def _double_clicked(self, index) -> None:
        if COLUMNS[index.column()][0] not in EDITABLE:
            self._open()

    def _open(self) -> None:
        paths = self.selected_paths()
        if paths:
            self.openRequested.emit(paths[0])

    def _compare(self) -> None:
        paths = self.selected_paths()
        if len(paths) >= 2:
            self.compareRequested.emit(paths)
