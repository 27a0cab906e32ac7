"""The Sweep tab: the parameters to vary and their ranges (beside the Setup form, which gives everything
else), the trial count, objective, sampler, pruner and devices per trial; Start/Stop; a live sortable
trials table (the best marked), parallel coordinates and importances; selecting trials shows their
per-device loss curves in the plots (several: compared); stop or prune one trial; export the table
(CSV) and the figures (PNG/SVG/PDF). The sweep runs as a child ``multilane sweep`` process (process.py);
the tab follows its study, so closing or killing the app loses nothing: reopen the folder to resume."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from multilane.engine.errors import UserError
from multilane.gui.sweep.live_plots import SweepPlots
from multilane.gui.sweep.process import SweepProcess, check_params
from multilane.gui.sweep.space_editor import SpaceEditor
from multilane.gui.sweep.workers import HostWorkers
from multilane.gui.window.runs_table import _Item
from PySide6.QtCore import Qt, QTimer
from PySide6.QtGui import QFont
from PySide6.QtWidgets import (
    QAbstractItemView,
    QComboBox,
    QFileDialog,
    QFrame,
    QGridLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QScrollArea,
    QSpinBox,
    QSplitter,
    QTableWidget,
    QVBoxLayout,
    QWidget,
)

POLL_MS = 1000


class SweepTab(QWidget):
    def __init__(self, window: Any) -> None:
        super().__init__()
        self.window = window  # the main window: its form and devices, its plots (open_run / compare_runs)
        self.process: SweepProcess | None = None
        self.sweep: Any = None  # the followed sweep (engine.sweep.study.Sweep), once its folder exists
        self._rows: list[dict[str, Any]] = []
        self._finished_count = -1

        self.space = SpaceEditor()
        self.trials = QSpinBox()
        self.trials.setRange(1, 100_000)
        self.trials.setValue(10)
        self.per_trial = QSpinBox()
        self.per_trial.setRange(1, 64)
        self.per_trial.setToolTip("Devices per trial: the chosen devices are split into slots of this many")
        self.objective = QLineEdit("val_loss:min")
        self.objective.setToolTip("A logged metric and its direction: val_loss:min, accuracy:max, loss:min")
        self.sampler = QComboBox()
        self.sampler.addItems(["tpe", "random", "grid"])
        self.pruner = QComboBox()
        self.pruner.addItems(["median", "halving", "none"])
        self.seed = QLineEdit()
        self.seed.setPlaceholderText("none")
        self.name = QLineEdit("sweep")
        self.folder = QLineEdit("sweeps")
        self.folder.setToolTip("Where sweep folders go: each holds study.journal and one run folder per trial")
        form = QGridLayout()  # two columns: the table below gets the height
        fields = [("trials", self.trials), ("devices per trial", self.per_trial), ("objective", self.objective),
                  ("sampler", self.sampler), ("pruner", self.pruner), ("seed", self.seed), ("name", self.name),
                  ("sweeps folder", self.folder)]  # fmt: skip
        for i, (label, w) in enumerate(fields):
            form.addWidget(QLabel(label), i // 2, (i % 2) * 2)
            form.addWidget(w, i // 2, (i % 2) * 2 + 1)

        self.start_btn = QPushButton("Start sweep")
        self.start_btn.setStyleSheet("font-weight: bold;")
        self.stop_btn = QPushButton("Stop sweep")
        self.open_btn = QPushButton("Open sweep…")
        self.export_btn = QPushButton("Export…")
        buttons = QHBoxLayout()
        for b in (self.start_btn, self.stop_btn, self.open_btn, self.export_btn):
            buttons.addWidget(b)
        self.why = QLabel()
        self.why.setWordWrap(True)
        self.why.setStyleSheet("color: #d62728;")
        self.state = QLabel("No sweep")
        self.state.setWordWrap(True)

        self.table = QTableWidget(0, 0)
        self.table.setSortingEnabled(True)
        self.table.setSelectionBehavior(QAbstractItemView.SelectRows)
        self.table.setEditTriggers(QAbstractItemView.NoEditTriggers)
        self.table.verticalHeader().setVisible(False)
        self.show_btn = QPushButton("Show curves")
        self.stop_trial_btn = QPushButton("Stop trial")
        self.prune_btn = QPushButton("Prune trial")
        trial_bar = QHBoxLayout()
        for b in (self.show_btn, self.stop_trial_btn, self.prune_btn):
            trial_bar.addWidget(b)
        trial_bar.addStretch(1)
        self.plots = SweepPlots()
        self.workers = HostWorkers(self)  # the storage, and workers started on SSH hosts

        top = QWidget()
        tv = QVBoxLayout(top)
        tv.setContentsMargins(0, 0, 0, 0)
        tv.addWidget(QLabel("<b>Parameters to vary</b> (everything else comes from the Setup tab)"))
        tv.addWidget(self.space)
        tv.addLayout(form)
        tv.addWidget(self.workers)
        tv.addWidget(self.why)
        tv.addLayout(buttons)
        tv.addWidget(self.state)
        mid = QWidget()
        mv = QVBoxLayout(mid)
        mv.setContentsMargins(0, 0, 0, 0)
        mv.addWidget(self.table, 1)
        mv.addLayout(trial_bar)
        self.scroll = scroll = (
            QScrollArea()
        )  # the settings scroll, so that the trials table keeps its rows on a small screen
        scroll.setWidget(top)
        scroll.setWidgetResizable(True)
        scroll.setFrameShape(QFrame.NoFrame)
        split = QSplitter(Qt.Vertical)
        for w in (scroll, mid, self.plots):
            split.addWidget(w)
        split.setSizes([330, 260, 200])
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addWidget(split)

        self.start_btn.clicked.connect(lambda: self.start())
        self.stop_btn.clicked.connect(lambda: self.stop())
        self.open_btn.clicked.connect(self._open_dialog)
        self.export_btn.clicked.connect(self._export_dialog)
        self.show_btn.clicked.connect(lambda: self.show_selected())
        self.stop_trial_btn.clicked.connect(lambda: self.request_selected("stop"))
        self.prune_btn.clicked.connect(lambda: self.request_selected("prune"))
        self.table.itemSelectionChanged.connect(self._selection_changed)
        self.space.changed.connect(self.validate)
        self.timer = QTimer(self)
        self.timer.timeout.connect(self.poll)
        self.timer.start(POLL_MS)
        self.validate()

    # -- starting and stopping -------------------------------------------------------------------------
    def running(self) -> bool:
        return self.process is not None and self.process.running()

    def validate(self) -> str | None:
        task = self.window.config_dict().get("task", {}).get("name", "digits")
        problem = None if self.space.specs() else "add at least one parameter to vary"
        problem = problem or check_params(self.space.specs(), task)
        self.why.setText(problem or "")
        self.why.setVisible(bool(problem))
        resumable = self._resumable()
        self.start_btn.setText("Resume sweep" if resumable else "Start sweep")
        self.start_btn.setEnabled(not self.running() and (problem is None or resumable))
        self.stop_btn.setEnabled(self.running())
        return problem

    def settings(self) -> dict[str, Any]:
        seed = self.seed.text().strip()
        return {
            "devices": self.window.config_dict()["devices"]["use"],
            "trials": self.trials.value(),
            "per_trial": self.per_trial.value(),
            "objective": self.objective.text().strip() or "val_loss:min",
            "sampler": self.sampler.currentText(),
            "pruner": self.pruner.currentText(),
            "seed": int(seed) if seed.isdigit() else None,
            "name": self.name.text().strip() or "sweep",
            "storage": self.workers.storage.text().strip() or None,
        }

    def start(self) -> bool:
        """Start a new sweep of the Setup form's config (or resume the opened, unfinished one)."""
        if self.running():
            return False
        if self._resumable():
            self.process = SweepProcess.resume(str(self.sweep.folder), self.window.config_dict()["devices"]["use"])
        else:
            if self.validate():
                return False
            config = self.window.config_dict()
            self.sweep = None
            self.process = SweepProcess.start(config, self.space.specs(), self.settings(), self.folder.text())
        self.state.setText("Starting the sweep…")
        self.validate()
        return True

    def stop(self) -> None:
        """Stop the sweep: running trials stop with a checkpoint and are re-queued for a resume."""
        if self.process is not None:
            self.process.stop()
            self.state.setText("Stopping: running trials finish their step and are re-queued…")

    def open_sweep(self, folder: str) -> bool:
        """Follow a sweep folder (another process may be running it); resume it with Start if it is unfinished."""
        from multilane.engine.sweep.study import Sweep

        try:
            self.sweep = Sweep.open(folder)
        except UserError as e:
            self.state.setText(str(e))
            return False
        self.process = None
        self._finished_count = -1
        self._show_spec(self.sweep.spec)
        self.poll()
        return True

    def _show_spec(self, spec: Any) -> None:
        """An opened sweep's own settings in the tab (a resume keeps them)."""
        self.space.table.setRowCount(0)
        for p in spec.params:
            text = ",".join(map(str, p.choices)) if p.kind == "choice" else f"{p.low:g}:{p.high:g}"
            self.space.add_row(p.key, p.kind, text)
        self.trials.setValue(spec.trials)
        self.per_trial.setValue(spec.per_trial)
        self.objective.setText(f"{spec.objective}:{'max' if spec.direction == 'maximize' else 'min'}")
        self.sampler.setCurrentText(spec.sampler)
        self.pruner.setCurrentText(spec.pruner)
        self.seed.setText("" if spec.seed is None else str(spec.seed))
        self.name.setText(spec.name)
        self.folder.setText(str(self.sweep.folder.parent))
        self.workers.storage.setText(self.sweep.storage_url or "")

    def _resumable(self) -> bool:
        if self.sweep is None or self.running():
            return False
        try:
            c = self.sweep.counts()
        except Exception:  # its database does not answer (poll says so)
            return False
        return c["running"] == 0 and c["done"] < self.sweep.spec.trials

    # -- following -------------------------------------------------------------------------------------
    def poll(self) -> None:
        try:
            self._poll()
        except Exception as e:  # a shared study's database that stopped answering: the table stays as it was
            if self.sweep is None or not self.sweep.storage_url:
                raise
            self.state.setText(f"Cannot read the study from its storage: {(str(e).splitlines() or [''])[0][:200]}")

    def _poll(self) -> None:
        if self.sweep is None and self.process is not None:
            folder = self.process.folder()
            if folder is not None and (folder / "sweep.json").exists():
                from multilane.engine.sweep.study import Sweep

                try:
                    self.sweep = Sweep.open(folder)
                except UserError:
                    self.sweep = None
        if self.process is not None and not self.process.running():
            err = self.process.error_line()
            if err:
                self.state.setText(f"The sweep stopped: {err}")
        if self.sweep is None:
            self.validate()
            return
        from multilane.engine.sweep.rows import trial_rows

        self._rows = trial_rows(self.sweep.study)
        self._fill_table()
        c = self.sweep.counts()
        spec = self.sweep.spec
        what = "running" if self.running() or c["running"] else "stopped" if c["done"] < spec.trials else "finished"
        best = next((r for r in self._rows if r["is_best"]), None)
        text = f"{self.sweep.folder.name}: {what} · {c['done']} of {spec.trials} trials done"
        if best is not None:
            text += f" · best: trial {best['number']}, {spec.objective} {best['value']:.4g}"
        if not (self.process is not None and self.process.error_line()):
            self.state.setText(text)
        if c["done"] != self._finished_count:  # the figures change only when a trial finishes
            self._finished_count = c["done"]
            keys = [p.key for p in spec.params]
            self.plots.update_from(
                self.sweep.study, keys, self._log_keys(), spec.objective, spec.direction == "maximize"
            )
        self.validate()
        self.workers.refresh()

    def _log_keys(self) -> set[str]:
        return {p.key for p in self.sweep.spec.params if p.kind == "log"}

    def _fill_table(self) -> None:
        spec = self.sweep.spec
        keys = [p.key for p in spec.params]
        headers = ["#", "state", *(k.removeprefix("task.params.") for k in keys), spec.objective, "best so far",
                   "step", "duration (s)", "devices", "host"]  # fmt: skip
        selected = set(self.selected_numbers())
        self.table.setSortingEnabled(False)
        self.table.setColumnCount(len(headers))
        self.table.setHorizontalHeaderLabels(headers)
        self.table.setRowCount(len(self._rows))
        bold = QFont()
        bold.setBold(True)
        for i, r in enumerate(self._rows):
            cells = [
                _Item(f"{r['number']}{' ★' if r['is_best'] else ''}", float(r["number"])),
                _Item(r["state"], r["state"]),
            ]
            cells += [_value_item(r["params"].get(k)) for k in keys]
            cells += [_value_item(r["value"]), _value_item(r["best"]), _value_item(r["step"])]
            cells += [
                _value_item(None if r["duration_s"] is None else round(r["duration_s"], 1)),
                _Item(r["devices"], r["devices"]),
                _Item(r["host"], r["host"]),
            ]
            for j, cell in enumerate(cells):
                if r["is_best"]:
                    cell.setFont(bold)
                if r["error"]:
                    cell.setToolTip(r["error"])
                self.table.setItem(i, j, cell)
        self.table.setSortingEnabled(True)
        self.table.blockSignals(True)
        for i in range(self.table.rowCount()):
            if self._number_at(i) in selected:
                self.table.selectRow(i)
        self.table.blockSignals(False)

    # -- trials ------------------------------------------------------------------------------------------
    def _number_at(self, row: int) -> int | None:
        item = self.table.item(row, 0)
        return int(item.key) if item is not None else None

    def selected_numbers(self) -> list[int]:
        rows = sorted({i.row() for i in self.table.selectedIndexes()})
        return [n for n in (self._number_at(r) for r in rows) if n is not None]

    def _row(self, number: int) -> dict[str, Any] | None:
        return next((r for r in self._rows if r["number"] == number), None)

    def _selection_changed(self) -> None:
        self.show_selected()

    def show_selected(self) -> bool:
        """The selected trials' curves (each device's loss) in the plots: one shown, several compared."""
        paths = [r["run_dir"] for n in self.selected_numbers() if (r := self._row(n)) and r["run_dir"]]
        paths = [p for p in paths if (Path(p) / "metrics.jsonl").exists()]
        if not paths or self.window.is_running():
            return False
        return self.window.compare_runs(paths) if len(paths) > 1 else self.window.open_run(paths[0])

    def request_selected(self, action: str) -> list[int]:
        """Stop or prune the selected running trials (the sweep records them stopped or pruned)."""
        from multilane.engine.sweep.trial_run import request_trial

        done = []
        for n in self.selected_numbers():
            r = self._row(n)
            if r and r["state"] == "running" and r["run_dir"] and Path(r["run_dir"]).is_dir():
                request_trial(r["run_dir"], action)
                done.append(n)
        return done

    # -- export --------------------------------------------------------------------------------------------
    def export(
        self, out: str, formats: tuple[str, ...] = ("png", "svg", "pdf", "csv"), width_px: int = 1600
    ) -> list[Path]:
        """The trials table as CSV and the sweep figures as PNG/SVG/PDF, into ``out``."""
        from multilane.gui.sweep.figures import export_sweep

        if self.sweep is None:
            return []
        spec = self.sweep.spec
        keys = [p.key for p in spec.params]
        return export_sweep(self.sweep.study, keys, self._log_keys(), spec.objective, out, list(formats), width_px,
                            spec.direction == "maximize")  # fmt: skip

    def _export_dialog(self) -> None:
        out = QFileDialog.getExistingDirectory(self, "Export the sweep into")
        if out:
            written = self.export(out)
            self.state.setText(f"Exported {len(written)} files to {out}")

    def _open_dialog(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Open a sweep folder", self.folder.text())
        if folder:
            self.open_sweep(folder)


def _value_item(v: Any) -> _Item:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return _Item("", float("nan"))
    if isinstance(v, (bool, str)):
        return _Item(str(v), str(v))
    return _Item(f"{v:.4g}" if isinstance(v, float) else str(v), float(v))
