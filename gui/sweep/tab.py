"""The Sweep tab: the parameters to vary and their ranges (beside the Setup form, which gives everything
else) and the sweep's own settings (settings_form.py: trial count, objective, sampler, pruner, devices per
trial, trial timeout); the sweep's Start/Resume, Stop and Open under them, always in view. While the tab is
open the window's right side is the sweep (view.py): a live sortable trials table (the best marked),
parallel coordinates and importances; selecting trials shows their per-device loss curves under it
(several: compared); stop or prune one trial; export the table (CSV) and the figures (PNG/SVG/PDF). The
sweep runs as a child ``multilane sweep`` process (process.py); the tab follows its study, so closing or
killing the app loses nothing: reopen the folder, and its lost trials are recovered as the CLI's
``--resume`` does."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from multilane.engine.errors import UserError
from multilane.gui.sweep.process import SweepProcess, check_params, recover_lost_trials
from multilane.gui.sweep.settings_form import SweepSettings
from multilane.gui.sweep.space_editor import SpaceEditor
from multilane.gui.sweep.view import HINT, SweepView
from multilane.gui.sweep.workers import HostWorkers
from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import (
    QFileDialog,
    QFrame,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QScrollArea,
    QVBoxLayout,
    QWidget,
)

POLL_MS = 1000
RECOVER_EVERY_S = 5.0  # a followed sweep whose trials say "running" with no sweep of ours alive: checked this often


class SweepTab(QWidget):
    def __init__(self, window: Any) -> None:
        super().__init__()
        self.window = window  # the main window: its form and devices, its plots (open_run / compare_runs)
        self.process: SweepProcess | None = None
        self.sweep: Any = None  # the followed sweep (engine.sweep.study.Sweep), once its folder exists
        self._rows: list[dict[str, Any]] = []
        self._finished_count = -1

        self.space = SpaceEditor()
        self.form = SweepSettings()
        f = self.form
        self.trials, self.per_trial, self.objective, self.sampler, self.pruner = (
            f.trials, f.per_trial, f.objective, f.sampler, f.pruner)  # fmt: skip
        self.seed, self.name, self.folder, self.timeout = f.seed, f.name, f.folder, f.timeout

        self.start_btn = QPushButton("Start sweep")
        self.start_btn.setObjectName("sweep_start")
        self.start_btn.setStyleSheet("font-weight: bold;")
        self.stop_btn = QPushButton("Stop sweep")
        self.stop_btn.setObjectName("sweep_stop")
        self.stop_btn.setToolTip("Running trials stop with a checkpoint and are re-queued: Resume sweep carries on")
        self.open_btn = QPushButton("Open sweep…")
        buttons = QHBoxLayout()
        for b in (self.start_btn, self.stop_btn, self.open_btn):
            buttons.addWidget(b)
        self.why = QLabel()
        self.why.setWordWrap(True)
        self.why.setStyleSheet("color: #d62728;")
        self.state = QLabel("No sweep")
        self.state.setObjectName("sweep_state")
        self.state.setWordWrap(True)
        self.workers = HostWorkers(self)  # the storage, and workers started on SSH hosts

        # The sweep's side of the window (the main window shows it while this tab is open).
        self.view = SweepView()
        self.table, self.plots, self.export_btn = self.view.table, self.view.plots, self.view.export_btn
        self.shown = False  # whether the tab is open (the window's right side is the sweep)
        self._curves_shown = False  # selected trials' curves are in the window's run plots

        top = QWidget()
        tv = QVBoxLayout(top)
        tv.setContentsMargins(0, 0, 0, 0)
        tv.addWidget(QLabel("<b>Parameters to vary</b> (everything else comes from the Setup tab)"))
        tv.addWidget(self.space)
        tv.addWidget(self.form)
        tv.addWidget(self.workers)
        tv.addStretch(1)
        self.scroll = scroll = QScrollArea()  # the settings scroll; the sweep's buttons stay in view under it
        scroll.setWidget(top)
        scroll.setWidgetResizable(True)
        scroll.setFrameShape(QFrame.NoFrame)
        scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarAlwaysOff)  # the fields narrow with the column
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addWidget(scroll, 1)
        lay.addWidget(self.why)
        lay.addWidget(self.state)
        lay.addLayout(buttons)

        self.start_btn.clicked.connect(lambda: self.start())
        self.stop_btn.clicked.connect(lambda: self.stop())
        self.open_btn.clicked.connect(self._open_dialog)
        self.export_btn.clicked.connect(self._export_dialog)
        self.view.show_btn.clicked.connect(lambda: self.show_selected())
        self.view.stop_trial_btn.clicked.connect(lambda: self.request_selected("stop"))
        self.view.prune_btn.clicked.connect(lambda: self.request_selected("prune"))
        self.table.itemSelectionChanged.connect(self._selection_changed)
        self.space.changed.connect(self.validate)
        self._recovered_at = 0.0
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
        storage = self.workers.storage.text().strip() or None
        return self.form.values(self.window.config_dict()["devices"]["use"], storage)

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
        self._recover()  # a sweep that was killed: its dead trials lost and re-queued, as --resume does
        self._show_spec(self.sweep.spec)
        self.poll()
        return True

    def _recover(self) -> list[int]:
        """Trials "running" whose worker on this machine is gone: recorded lost and re-queued (the CLI's
        own recovery, process.recover_lost_trials); then the tab offers Resume sweep."""
        self._recovered_at = time.monotonic()
        if self.sweep is None or self.running():
            return []
        try:
            return recover_lost_trials(self.sweep)
        except Exception:  # a shared study's database that does not answer: poll says so
            return []

    def _show_spec(self, spec: Any) -> None:
        """An opened sweep's own settings in the tab (a resume keeps them)."""
        self.space.set_params(spec.params)
        self.form.show_spec(spec, self.sweep.folder.parent)
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
            self.process.cleanup()
            err = self.process.error_line()
            if err:
                self.state.setText(f"The sweep stopped: {err}")
        if self.sweep is None:
            self.validate()
            self.sync_window()
            return
        if self.process is not None and self.sweep.folder.is_dir():
            self.process.cleanup()  # the sweep holds its base config (sweep.json): the app's copy goes
        from multilane.engine.sweep.rows import trial_rows

        c = self.sweep.counts()
        due = time.monotonic() - self._recovered_at >= RECOVER_EVERY_S
        if c["running"] and not self.running() and due and self._recover():  # it died while we followed it
            c = self.sweep.counts()
        self._rows = trial_rows(self.sweep.study)
        self.view.fill(self._rows, self.sweep.spec)
        spec = self.sweep.spec
        what = "running" if self.running() or c["running"] else "stopped" if c["done"] < spec.trials else "finished"
        best = next((r for r in self._rows if r["is_best"]), None)
        text = f"{self.sweep.folder.name}: {what} · {c['done']} of {spec.trials} trials done"
        if c["lost"]:
            text += f" · {c['lost']} lost (re-queued)"
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
        self.sync_window()

    def _log_keys(self) -> set[str]:
        return {p.key for p in self.sweep.spec.params if p.kind == "log"}

    # -- the window while the tab is open ----------------------------------------------------------------
    def set_shown(self, shown: bool) -> None:
        """The tab opened (the window's right side becomes the sweep) or closed (back to the run plots)."""
        self.shown = shown
        self.sync_window()

    def sync_window(self) -> None:
        """While the tab is open: the sweep's view on the right, the run plots under it only when they show
        selected trials; the run's Start/Pause/Stop hidden unless a run is live (then Pause/Stop apply)."""
        w = self.window
        view_run, run_bar = getattr(w, "run_view", None), getattr(w, "run_bar", None)
        if view_run is None or run_bar is None:
            return
        self.view.setVisible(self.shown)
        curves = self.shown and self._curves_shown and not w.is_running()
        split = self.view.parentWidget()
        if curves and view_run.isHidden() and split is not None:  # the curves appear: under the sweep, half
            h = split.height()
            split.setSizes([h - h // 2, h // 2])
        view_run.setVisible(not self.shown or curves)
        w.plots.set_compact(self.shown)  # the loss alone: every plot would not fit under the sweep
        if self.shown:
            w.summary.hide()  # the trial's numbers are in the table
        run_bar.setVisible(not self.shown or w.is_running())
        w.why.setVisible(not self.shown and bool(w.why.text()))
        if self.shown:
            self.view.hint.setText(
                "A run is training: its plots are on the Setup tab." if w.is_running() else "" if curves else HINT
            )

    # -- trials ------------------------------------------------------------------------------------------
    def _number_at(self, row: int) -> int | None:
        return self.view.number_at(row)

    def selected_numbers(self) -> list[int]:
        return self.view.selected_numbers()

    def _row(self, number: int) -> dict[str, Any] | None:
        return next((r for r in self._rows if r["number"] == number), None)

    def _selection_changed(self) -> None:
        self.show_selected()

    def show_selected(self) -> bool:
        """The selected trials' curves (each device's loss) in the plots: one shown, several compared."""
        paths = [r["run_dir"] for n in self.selected_numbers() if (r := self._row(n)) and r["run_dir"]]
        paths = [p for p in paths if (Path(p) / "metrics.jsonl").exists()]
        if not paths or self.window.is_running():
            self._curves_shown = False
            self.sync_window()
            return False
        # the form stays: it is the next sweep's base, not the trial's settings
        shown = self.window.compare_runs(paths, form=False)
        self._curves_shown = bool(shown)
        self.sync_window()
        return shown

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
