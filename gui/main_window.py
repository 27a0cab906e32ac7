"""The Multilane window: devices and hyperparameters on the left, live plots on the right."""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path
from typing import Any

from multilane.engine.config import RunConfig, build_config
from multilane.engine.errors import UserError
from multilane.engine.progress import data_wait
from multilane.engine.tasks.loader import is_task_file
from multilane.gui import follow
from multilane.gui.config_form import ConfigForm
from multilane.gui.device_picker import DevicePicker
from multilane.gui.plots import PlotPanel
from multilane.gui.runs_table import RunsTable
from multilane.gui.window_files import RunFilesMixin
from multilane.gui.worker import RunHandle, TrainWorker
from PySide6.QtCore import QByteArray, QSettings, Qt, QTimer
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QFileDialog,
    QHBoxLayout,
    QLabel,
    QMainWindow,
    QMessageBox,
    QPushButton,
    QScrollArea,
    QSlider,
    QSplitter,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

HOLD_MAX_S = 0.1  # the longest a redraw may hold training (it normally ends after the paint)
HOLD_WAIT_S = 0.02  # the longest the window waits for the step in progress before redrawing anyway
REDRAW_MS = 100  # 10 Hz; a refresh and repaint of the six plots cost ~20 ms (bench/gui_latency_probe.py)


def _freeze_heap() -> None:
    """Collect what is garbage now, then exempt every live object from future collections.

    Python's full (generation-2) collections walk every object in the process: with torch, Qt and
    pyqtgraph loaded that took 100-230 ms, in whichever thread triggered it, holding the GIL: the
    window froze for that long. After ``gc.freeze()`` they walk only what was made since (the worker
    freezes again once the run is set up). Unfreezing first, at each Start, lets the previous run's
    cycles be collected.
    """
    gc.unfreeze()
    gc.collect()
    gc.freeze()


def _fmt_duration(s: float) -> str:
    s = int(max(0, s))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class MainWindow(RunFilesMixin, QMainWindow):
    def __init__(self, settings: QSettings | None = None) -> None:
        super().__init__()
        self.settings = settings or QSettings("Multilane", "Multilane")
        self.setWindowTitle("Multilane")
        self.run: RunHandle | None = None
        self.run_info: dict[str, Any] = {}
        self.last_result: dict[str, Any] | None = None
        self.paused = False
        self._active = False
        self._resume_from: str | None = None  # the run folder the current run resumes, if any
        self._t_start = 0.0
        self._last_train: dict[str, Any] = {}
        self._hold_pending = False

        # -- left: devices, hyperparameters, controls --------------------------------------------
        self.devices = DevicePicker()
        self.form = ConfigForm()
        left_inner = QWidget()
        lv = QVBoxLayout(left_inner)
        self.devices_label = QLabel("<b>Devices</b>")
        lv.addWidget(self.devices_label)
        lv.addWidget(self.devices)
        lv.addWidget(self.form)
        scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setWidget(left_inner)
        scroll.setMinimumWidth(340)

        self.start_btn = QPushButton("Start")
        self.start_btn.setObjectName("start")
        self.pause_btn = QPushButton("Pause")
        self.pause_btn.setObjectName("pause")
        self.stop_btn = QPushButton("Stop")
        self.stop_btn.setObjectName("stop")
        self.start_btn.setStyleSheet("font-weight: bold;")
        self.why = QLabel()
        self.why.setObjectName("why")
        self.why.setWordWrap(True)
        self.why.setStyleSheet("color: #d62728;")
        buttons = QHBoxLayout()
        for b in (self.start_btn, self.pause_btn, self.stop_btn):
            buttons.addWidget(b)
        left = QWidget()
        left_layout = QVBoxLayout(left)
        left_layout.setContentsMargins(6, 6, 6, 6)
        self.runs_table = RunsTable()
        self.runs_table.openRequested.connect(self.open_run)
        self.runs_table.compareRequested.connect(self.compare_runs)
        self.tabs = QTabWidget()
        self.tabs.addTab(scroll, "Setup")
        self.tabs.addTab(self.runs_table, "Runs")
        self.tabs.currentChanged.connect(self._tab_changed)
        self._setup_sizes: list[int] | None = None
        left_layout.addWidget(self.tabs, 1)
        left_layout.addWidget(self.why)
        left_layout.addLayout(buttons)

        # -- right: plot controls and plots --------------------------------------------------------
        self.plots = PlotPanel()
        self.plots.after_paint = self._release_hold
        self.x_mode = QComboBox()
        self.x_mode.addItems(["step", "time"])
        self.x_mode.setToolTip("X axis of every plot: optimizer step or elapsed wall time")
        self.smooth = QSlider(Qt.Horizontal)
        self.smooth.setRange(0, 99)
        self.smooth.setFixedWidth(120)
        self.smooth.setToolTip("Smoothing (EMA) of the loss curves; the raw curve stays faint behind")
        self.log_y = QCheckBox("log y")
        self.auto_range = QCheckBox("auto range")
        self.auto_range.setChecked(True)
        export_btn = QPushButton("Export…")
        bar = QHBoxLayout()
        bar.addWidget(QLabel("x axis"))
        bar.addWidget(self.x_mode)
        bar.addSpacing(12)
        bar.addWidget(QLabel("smoothing"))
        bar.addWidget(self.smooth)
        bar.addWidget(self.log_y)
        bar.addWidget(self.auto_range)
        bar.addStretch(1)
        bar.addWidget(export_btn)
        right = QWidget()
        rv = QVBoxLayout(right)
        rv.setContentsMargins(4, 6, 6, 6)
        rv.addLayout(bar)
        rv.addWidget(self.plots, 1)

        split = QSplitter()
        split.addWidget(left)
        split.addWidget(right)
        split.setStretchFactor(1, 1)
        split.setSizes([380, 1000])
        self.splitter = split
        self.setCentralWidget(split)

        # The run's state (left) and passing notes (right, warnings and exports) in two labels: a
        # temporary status-bar message would hide the final "Finished at step N".
        self.status_label = QLabel("Ready")
        self.note_label = QLabel()
        self.note_label.setObjectName("note")
        self.statusBar().addWidget(self.status_label, 1)
        self.statusBar().addPermanentWidget(self.note_label)
        self._note_timer = QTimer(self)
        self._note_timer.setSingleShot(True)
        self._note_timer.timeout.connect(self.note_label.clear)
        self.shown_run_dir: str | None = None

        self._make_menus()
        self.start_btn.clicked.connect(lambda: self.start())
        self.pause_btn.clicked.connect(lambda: self.toggle_pause())
        self.stop_btn.clicked.connect(lambda: self.stop())
        export_btn.clicked.connect(lambda: self.export_dialog())
        self.x_mode.currentTextChanged.connect(self.plots.set_x_mode)
        self.smooth.valueChanged.connect(lambda v: self.plots.set_smoothing(v / 100.0))
        self.log_y.toggled.connect(self.plots.set_log_y)
        self.auto_range.toggled.connect(self.plots.set_auto_range)
        self.plots.sigAutoXLost.connect(self._auto_range_lost)
        self.plots.sigExportRequested.connect(
            lambda what: self.export_bundle_dialog() if what == "bundle" else self.export_dialog()
        )
        self.form.changed.connect(self.validate)
        self.devices.changed.connect(self.validate)

        self.timer = QTimer(self)
        self.timer.timeout.connect(self._tick)
        self.timer.start(REDRAW_MS)
        self.idle_timer = QTimer(self)
        self.idle_timer.timeout.connect(self._idle_tick)
        self.idle_timer.start(1000)

        self._restore()
        self._set_running(False)
        self.validate()
        self.plots.set_title("Choose devices and hyperparameters, then press Start (Ctrl+Enter).")

    # -- menus -------------------------------------------------------------------------------------
    def _make_menus(self) -> None:
        def act(menu, text, slot, shortcut=None, name=None):
            a = QAction(text, self)
            if shortcut:
                a.setShortcut(QKeySequence(shortcut))
            a.triggered.connect(lambda _checked=False: slot())
            if name:
                a.setObjectName(name)
            menu.addAction(a)
            return a

        f = self.menuBar().addMenu("&File")
        act(f, "Open run…", self.open_run_dialog, "Ctrl+O")
        act(f, "Compare with run…", self.compare_dialog, "Ctrl+Shift+O")
        act(f, "Follow run…", self.follow_run_dialog, "Ctrl+Shift+F")
        f.addSeparator()
        act(f, "Load preset…", self.load_preset_dialog, "Ctrl+L")
        act(f, "Save preset…", self.save_preset_dialog, "Ctrl+S")
        f.addSeparator()
        act(f, "Export figures and CSV…", self.export_dialog, "Ctrl+E")
        act(f, "Export bundle…", self.export_bundle_dialog, "Ctrl+Shift+E")
        f.addSeparator()
        act(f, "Quit", self.close, "Ctrl+Q")
        r = self.menuBar().addMenu("&Run")
        self.start_action = act(r, "Start", self.start, "Ctrl+Return", "action.start")
        self.pause_action = act(r, "Pause / Resume", self.toggle_pause, "Ctrl+P", "action.pause")
        self.stop_action = act(r, "Stop", self.stop, "Ctrl+.", "action.stop")
        act(r, "Resume from run folder…", self.resume_dialog, "Ctrl+Shift+R")
        r.addSeparator()
        self.hold_action = QAction("Smooth window (training yields while plots redraw)", self)
        self.hold_action.setObjectName("action.hold")
        self.hold_action.setCheckable(True)
        self.hold_action.setChecked(True)
        self.hold_action.setToolTip(
            "Training waits between steps while the plots repaint, so the two do not fight over Python's GIL "
            "(on a busy CPU, training in the window is faster for it); untick to give training every cycle"
        )
        self.hold_action.toggled.connect(self._set_hold)
        r.addAction(self.hold_action)
        self.ddp_action = QAction("One process per device (ddp, runs as a child process)", self)
        self.ddp_action.setObjectName("action.ddp")
        self.ddp_action.setCheckable(True)
        self.ddp_action.setToolTip("devices.strategy = ddp: DistributedDataParallel, one process per device")
        r.addAction(self.ddp_action)

    # -- config --------------------------------------------------------------------------------------
    def config_dict(self) -> dict[str, Any]:
        d = self.form.values()
        d["devices"] = {**d.get("devices", {}), **self.devices.values()}
        if self.ddp_action.isChecked():
            d["devices"]["strategy"] = "ddp"
        return d

    def validate(self) -> list[str]:
        """Mark invalid fields; keep Start disabled, saying why, while any is invalid."""
        problems = self.form.errors(self.config_dict())
        if not self.devices.selected():
            problems.insert(0, "choose at least one device")
        self.why.setText(problems[0] if problems else "")
        self.why.setVisible(bool(problems))
        can = not problems and not self.is_running()
        self.start_btn.setEnabled(can)
        self.start_action.setEnabled(can)
        self.start_btn.setToolTip(problems[0] if problems else "Start training (Ctrl+Enter)")
        return problems

    def set_config(self, cfg: RunConfig) -> None:
        self.form.set_config(cfg)
        self.devices.set_values(cfg.devices.model_dump())
        self.ddp_action.setChecked(cfg.devices.strategy == "ddp")
        self.validate()

    # -- run control ---------------------------------------------------------------------------------
    def is_running(self) -> bool:
        """A run is active from Start until its finished signal reaches the window."""
        return self._active

    def start(self, resume_from: str | None = None, overrides: dict[str, Any] | None = None) -> bool:
        if self.is_running():
            return False
        if not resume_from and self.validate():
            return False
        config = None
        if not resume_from:
            try:
                config = build_config(self.config_dict(), "settings")
            except UserError as e:
                self.why.setText(str(e))
                return False
        if config is not None and config.devices.strategy == "ddp":
            handle = follow.start_child_run(config)  # ddp ranks are processes: the app follows them
        else:
            handle = RunHandle(TrainWorker(config, resume_from=resume_from, overrides=overrides))
        self._resume_from = resume_from
        self._begin(handle, config)
        if config is not None:
            self.settings.setValue("last_config", json.dumps(config.to_dict()))
        return True

    def follow_run(self, path: str) -> bool:
        """File > Follow run: show a run another process is writing, live (Pause/Stop via its control file)."""
        if self.is_running():
            return False
        if not Path(path).is_dir():
            QMessageBox.warning(self, "Not a run folder", f"{path} is not a folder")
            return False
        self._resume_from = None
        self._begin(follow.follow(path), None)
        return True

    def follow_run_dialog(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Follow run folder", self._runs_dir())
        if path:
            self.follow_run(path)

    def _begin(self, handle: Any, config: RunConfig | None) -> None:
        """Show a run from its start: one in this process's thread, or one another process writes."""
        self.plots.reset()
        self._last_train = {}
        _freeze_heap()
        worker = handle.worker
        worker.started.connect(self._on_started)
        worker.record.connect(self._on_record)
        worker.finished.connect(self._on_finished)
        if self.run is not None:
            self.run.thread.wait(10_000)  # the previous run's thread is past its last signal
        self.run = handle
        self._active = True
        self._hold_pending = False
        self.paused = False
        self._t_start = time.monotonic()
        self._set_running(True)
        self.status_label.setText(_starting_text(config))
        self.run.start()

    def toggle_pause(self) -> None:
        if not self.is_running():
            return
        if self.paused:
            self.run.worker.resume()
        else:
            self.run.worker.pause()
        self.paused = not self.paused
        self.pause_btn.setText("Resume" if self.paused else "Pause")

    def stop(self) -> None:
        if self.is_running():
            self.run.worker.stop()
            self.status_label.setText("Stopping after this step…")

    def _set_running(self, running: bool) -> None:
        self.pause_btn.setEnabled(running)
        self.stop_btn.setEnabled(running)
        self.pause_action.setEnabled(running)
        self.stop_action.setEnabled(running)
        self.pause_btn.setText("Pause")
        self.devices.setEnabled(not running)
        self.form.setEnabled(not running)
        if not running:
            self.validate()
        else:
            self.start_btn.setEnabled(False)
            self.start_action.setEnabled(False)

    # -- worker signals (GUI thread) -------------------------------------------------------------------
    def _on_started(self, info: dict) -> None:
        self.run_info = info
        self.shown_run_dir = info["run_dir"]
        self.plots.data.name = Path(info["run_dir"]).name
        self.plots.set_title(f"{Path(info['run_dir']).name} · {', '.join(info['devices'])}")

    def _on_record(self, rec: dict) -> None:
        self.plots.add_record(rec)
        kind = rec.get("kind")
        if kind == "train":
            self._last_train = rec
        elif kind == "telemetry":
            self.devices.update_from_telemetry(rec)
        elif kind == "event" and rec.get("event") == "warning":
            self.note(f"⚠ {rec['message']}", 30_000)
        elif kind == "eval" and rec.get("sample"):
            # A task's text sample (charlm): one line at the status bar's right; all of it is in samples.txt.
            text = " ⏎ ".join(line for line in rec["sample"].splitlines() if line.strip())
            self.note(f"Sample at step {rec['step']}: {text[:300]}", 30_000)

    def _on_finished(self, result: dict) -> None:
        self.last_result = result
        self._active = False
        self._set_running(False)
        self.plots.refresh()
        self.plots.fit_x()  # nothing more will come: no empty quarter at the right
        if self.tabs.currentWidget() is self.runs_table:
            self.refresh_runs()
        status = result["status"]
        if status == "rejected" and result.get("task_file_changed") and self._resume_from:
            self._ask_to_run_changed_task_file(self._resume_from, result)
        elif status == "rejected":
            self.status_label.setText(f"Not started: {result['message']}")
            box = QMessageBox(QMessageBox.Warning, "Cannot start", result["message"], parent=self)
            box.open()
            self.error_box = box
        elif status == "failed":
            # The message names the step that failed (the one after the last completed step).
            self.status_label.setText(f"Failed: {result['message']}")
            box = QMessageBox(
                QMessageBox.Critical,
                "Run failed",
                f"{result['message']}\n\nRun folder: {result['run_dir'] or '-'}",
                parent=self,
            )
            if result.get("traceback"):
                box.setDetailedText(result["traceback"])
            box.open()  # not exec(): the app stays responsive, and tests are not blocked
            self.error_box = box
        else:
            msg = f" — {result['message']}" if result.get("message") else ""
            self.status_label.setText(f"{status.capitalize()} at step {result['step']}{msg} · {result['run_dir']}")
        self.validate()

    def _ask_to_run_changed_task_file(self, run_dir: str, result: dict) -> None:
        """A resume whose task file moved or changed: say so, and run the file as it is now only if
        the user agrees (the CLI's ``--task``)."""
        path = result["task_file_changed"]
        answer = QMessageBox.question(
            self, "Task file changed", f"{result['message']}\n\nResume the run with {path} as it is now?"
        )
        if answer == QMessageBox.Yes:
            self.start(resume_from=run_dir, overrides={"task.name": path})
        else:
            self.status_label.setText(f"Not resumed: {result['message']}")

    def _auto_range_lost(self) -> None:
        self.auto_range.blockSignals(True)
        self.auto_range.setChecked(False)
        self.auto_range.blockSignals(False)
        self.plots.set_auto_range(False)

    @property
    def hold_for_redraw(self) -> bool:
        """Run > Smooth window: training waits while the plots repaint."""
        return self.hold_action.isChecked()

    def _set_hold(self, on: bool) -> None:
        self.settings.setValue("hold_for_redraw", on)
        if not on and self.run is not None:
            self.run.control.release()

    def _tick(self) -> None:
        if (
            self.hold_for_redraw
            and self.is_running()
            and not self.paused
            and self.plots.dirty
            and not self._hold_pending
        ):
            # Training waits (between steps) while the plots update and paint: the GUI thread then has
            # the GIL to itself. We let the step in progress finish first (waiting releases the GIL, so
            # it finishes sooner), but no longer than HOLD_WAIT_S. The hold ends after the paint, or by
            # itself after HOLD_MAX_S; while a hold saw no paint (a minimized window paints nothing), no
            # new one is taken.
            self._hold_pending = True
            self.run.control.hold(HOLD_MAX_S)
            self.run.control.wait_until_held(HOLD_WAIT_S)
        self.plots.refresh()
        if self.is_running() and self._last_train:
            r = self._last_train
            total = self.run_info.get("total_steps") or 0
            elapsed = time.monotonic() - self._t_start
            sps = r.get("samples_per_s") or 0
            step_ms = r.get("step_ms") or 0
            eta = (total - r["step"]) * step_ms / 1000 if step_ms else 0
            self.status_label.setText(
                f"{'Paused · ' if self.paused else ''}step {r['step']:,}/{total:,} · epoch {r.get('epoch') or 0:.2f} · "
                f"{sps:,.0f} samples/s{data_wait(r)} · elapsed {_fmt_duration(elapsed)} · ETA {_fmt_duration(eta)}"
            )

    def _release_hold(self) -> None:
        self._hold_pending = False
        if self.run is not None:
            self.run.control.release()

    def _idle_tick(self) -> None:
        if not self.is_running():
            self.devices.update_idle()
            self.devices_label.setText(f"<b>Devices</b> &nbsp; CPU {self.devices.cpu_pct:.0f}% busy")

    # -- settings and closing ------------------------------------------------------------------------------
    def _restore(self) -> None:
        geometry = self.settings.value("geometry")
        if isinstance(geometry, QByteArray):
            self.restoreGeometry(geometry)
        else:  # first launch: 1400 x 900, or what fits on a smaller screen (a 1024 x 700 laptop)
            screen = self.screen().availableGeometry()
            self.resize(min(1400, screen.width()), min(900, screen.height()))
        self.hold_action.setChecked(self.settings.value("hold_for_redraw", True, type=bool))
        state = self.settings.value("splitter")
        if isinstance(state, QByteArray):
            self.splitter.restoreState(state)
        last = self.settings.value("last_config")
        if last:
            try:
                self.set_config(build_config(json.loads(last), "last config"))
            except (UserError, ValueError, TypeError):
                pass  # an old or broken saved config: start from the defaults

    def confirm_close(self) -> bool:
        answer = QMessageBox.question(
            self, "A run is in progress", "Stop the run (it finishes its step and saves a checkpoint) and quit?"
        )
        return answer == QMessageBox.Yes

    def closeEvent(self, event) -> None:
        if self.is_running():
            if not self.confirm_close():
                event.ignore()
                return
            self.status_label.setText("Stopping…")
            self.run.stop_and_wait()
        if self.run is not None:
            self.run.thread.wait(10_000)
        self.settings.setValue("geometry", self.saveGeometry())
        self.settings.setValue("splitter", self.splitter.saveState())
        self.timer.stop()
        self.idle_timer.stop()
        event.accept()


def _starting_text(config: RunConfig | None) -> str:
    """What the status bar says at Start: a task file that is about to run is named in full."""
    if config is not None and is_task_file(config.task.name):
        return f"Starting… running task file {Path(config.task.name).expanduser().resolve()}"
    return "Starting…"
