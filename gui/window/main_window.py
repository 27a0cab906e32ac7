"""The Multilane window: devices and hyperparameters on the left, live plots on the right."""

from __future__ import annotations

import json
from typing import Any

from multilane.engine.config import RunConfig, build_config
from multilane.engine.errors import UserError
from multilane.gui.health.view import HealthView
from multilane.gui.hosts.host_bar import HostBar, RemoteRunsMixin
from multilane.gui.hosts.host_picks import HostPicks
from multilane.gui.hosts.remote_resume import RemoteResumeMixin
from multilane.gui.plots.panel import PlotPanel
from multilane.gui.runs.redraw_pace import REDRAW_MS, RedrawPace
from multilane.gui.runs.run_mode import SeparateProcessOption
from multilane.gui.runs.worker import RunHandle
from multilane.gui.sweep.tab import SweepTab
from multilane.gui.table.runs_table import RunsTable
from multilane.gui.window.config_form import ConfigForm
from multilane.gui.window.device_picker import DevicePicker
from multilane.gui.window.files import RunFilesMixin
from multilane.gui.window.fit_forecast import FitForecast
from multilane.gui.window.run_control import RunControlMixin
from multilane.gui.window.summary_view import SummaryView
from PySide6.QtCore import QByteArray, QSettings, Qt, QTimer
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
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


class MainWindow(RunControlMixin, RunFilesMixin, RemoteRunsMixin, RemoteResumeMixin, QMainWindow):
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
        self._form_loaded = ""  # the form as last loaded or started (see form_edited)
        self._last_train: dict[str, Any] = {}
        self._hold_pending = False

        # -- left: devices, hyperparameters, controls --------------------------------------------
        self.devices = DevicePicker()
        self.hosts = HostBar(self.settings)
        self.form = ConfigForm()
        self.separate = SeparateProcessOption(self.settings, self.form.editors["devices.strategy"].widget)
        self.form.add_row("devices", "process", self.separate)
        left_inner = QWidget()
        lv = QVBoxLayout(left_inner)
        self.devices_label = QLabel("<b>Devices</b>")
        lv.addWidget(self.devices_label)
        lv.addWidget(self.hosts)
        lv.addWidget(self.devices)
        self.fit = FitForecast(self.devices, self.config_dict, lambda: self.hosts.host is not None)
        lv.addWidget(self.fit)  # will it fit: the forecast in the picker's "needs" column
        self.host_picks = HostPicks(self.hosts, self.devices, self)  # picks on several hosts: one ddp run
        lv.addWidget(self.host_picks.widget)
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
        self.run_bar = QWidget()  # the run's buttons: hidden while the Sweep tab shows the sweep's own
        buttons = QHBoxLayout(self.run_bar)
        buttons.setContentsMargins(0, 0, 0, 0)
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
        self.sweep_tab = SweepTab(self)
        self.tabs.addTab(self.sweep_tab, "Sweep")
        self.tabs.currentChanged.connect(self._tab_changed)
        self._setup_sizes: list[int] | None = None
        left_layout.addWidget(self.tabs, 1)
        left_layout.addWidget(self.why)
        left_layout.addWidget(self.run_bar)

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
        self.summary = SummaryView()
        rv.addWidget(self.summary)
        self.health_view = HealthView()
        self.views = QTabWidget()  # the curves, and the run's health (gui/health)
        self.views.addTab(self.plots, "Curves")
        self.views.addTab(self.health_view, "Health")
        self.views.currentChanged.connect(lambda _: self._refresh_health())
        rv.addWidget(self.views, 1)
        # While the Sweep tab is open the right side is the sweep (its view), the run plots under it
        # only when they show the selected trials (SweepTab.sync_window).
        self.run_view = right
        right_split = QSplitter(Qt.Vertical)
        right_split.addWidget(self.sweep_tab.view)
        right_split.addWidget(right)
        right_split.setChildrenCollapsible(False)
        right_split.setStretchFactor(1, 1)
        self.sweep_tab.view.setVisible(False)

        split = QSplitter()
        split.addWidget(left)
        split.addWidget(right_split)
        split.setStretchFactor(1, 1)
        split.setSizes([430, 970])  # the device list's columns whole at 1,400 px
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
        self.form.changed.connect(self.fit.clear)
        self.devices.changed.connect(self.fit.clear)
        self.hosts.hostChanged.connect(self._host_changed)
        self.hosts.hostChanged.connect(self._resume_action_text)  # a host picked: resume a run there
        self.hosts.devicesRead.connect(self._host_devices)

        self.redraw_pace = RedrawPace()
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
        self.offer_remote_runs()

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
        act(f, "Open TensorBoard logdir…", self.open_tensorboard_dialog, name="action.tensorboard")
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
        self.resume_action = act(r, "Resume from run folder…", self.resume_dialog, "Ctrl+Shift+R", "action.resume")
        r.addSeparator()
        self.hold_action = QAction("Smooth window (training yields while plots redraw)", self)
        self.hold_action.setObjectName("action.hold")
        self.hold_action.setCheckable(True)
        self.hold_action.setChecked(True)
        self.hold_action.setToolTip(
            "A run in the app's own thread waits between steps while the plots repaint, so the two do not fight "
            "over Python's GIL (on a busy CPU, training in the window is faster for it); untick to give training "
            "every cycle. A run in a separate process shares no GIL with the window: this does not apply"
        )
        self.hold_action.toggled.connect(self._set_hold)
        r.addAction(self.hold_action)

    # -- config --------------------------------------------------------------------------------------
    def config_dict(self) -> dict[str, Any]:
        d = self.form.values()
        d["devices"] = {**d.get("devices", {}), **self.devices.values()}
        return d

    def validate(self) -> list[str]:
        """Mark invalid fields; keep Start disabled, saying why, while any is invalid."""
        problems = self.form.errors(self.config_dict())
        if not self.devices.selected():
            problems.insert(0, "choose at least one device")
        self.why.setText(problems[0] if problems else "")
        sweep = getattr(self, "sweep_tab", None)  # the Sweep tab says its own why
        self.why.setVisible(bool(problems) and not (sweep is not None and sweep.shown))
        can = not problems and not self.is_running()
        self.start_btn.setEnabled(can)
        self.start_action.setEnabled(can)
        self.start_btn.setToolTip(problems[0] if problems else "Start training (Ctrl+Enter)")
        return problems

    def set_config(self, cfg: RunConfig, keep_runs_dir: bool = False) -> None:
        """Show ``cfg`` in the form; ``keep_runs_dir``: the form's runs folder stays (an opened run's
        settings replace the run's hyperparameters, not where the user keeps runs)."""
        if keep_runs_dir:
            runs_dir = self.form.editors["run.runs_dir"].get()
            cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"runs_dir": runs_dir})})
        self.form.set_config(cfg)
        self.devices.set_values(cfg.devices.model_dump())
        self.validate()
        self._form_loaded = self._form_key()

    def _form_key(self) -> str:
        d = self.config_dict()
        d.get("run", {}).pop("runs_dir", None)  # where runs go is the user's, not a run's setting
        return json.dumps(d, sort_keys=True, default=str)

    def form_edited(self) -> bool:
        """Whether the user changed the form since it was last loaded (a run, a preset) or started."""
        return self._form_key() != self._form_loaded

    def remember_form(self) -> None:
        """The next launch starts from the form as it is now (valid or not), not from the last Start."""
        self.settings.setValue("last_form", json.dumps(self.config_dict(), default=str))
        self._form_loaded = self._form_key()

    def ask_replace_form(self, run_name: str) -> bool:
        """Opening a run while the form holds edits: replace them with the run's settings?"""
        box = QMessageBox(QMessageBox.Question, "Replace your settings?", "", parent=self)
        box.setObjectName("ask.replace_form")
        box.setText(
            f"The form holds settings you changed. Show {run_name}'s settings in it instead? "
            "(Its curves are shown either way.)"
        )
        replace = box.addButton("Show the run's settings", QMessageBox.AcceptRole)
        keep = box.addButton("Keep my settings", QMessageBox.RejectRole)
        box.setDefaultButton(keep)
        box.exec()
        return box.clickedButton() is replace

    def show_summary(self, run_dir: str) -> bool:
        return self.summary.show_run(run_dir)

    def hide_summary(self) -> None:
        self.summary.hide()

    def _auto_range_lost(self) -> None:
        self.auto_range.blockSignals(True)
        self.auto_range.setChecked(False)
        self.auto_range.blockSignals(False)
        self.plots.set_auto_range(False)

    def _refresh_health(self) -> None:
        """The Health view follows the run the curves show, redrawn only while it is the tab shown."""
        if self.views.currentWidget() is not self.health_view:
            return
        if self.health_view.data is not self.plots.data:
            self.health_view.set_data(self.plots.data)
        else:
            self.health_view.refresh()

    def _idle_tick(self) -> None:
        self._refresh_health()
        if not self.is_running():
            self.devices.update_idle()
            if self.devices.host is None:
                self.devices_label.setText(f"<b>Devices</b> &nbsp; CPU {self.devices.cpu_pct:.0f}% busy")
            else:
                self.devices_label.setText("<b>Devices</b>")

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
        hidden = self.settings.value("runs_hidden_columns")
        if isinstance(hidden, str):
            self.runs_table.set_hidden_columns(hidden.split(","))
        form = self.settings.value("last_form")
        last = self.settings.value("last_config")  # what versions before the remembered form kept
        if form:
            try:
                data = json.loads(form)
                self.form.set_values(data)
                self.devices.set_values(data.get("devices") or {})
            except (ValueError, TypeError, AttributeError):
                pass  # a broken saved form: start from the defaults
        elif last:
            try:
                self.set_config(build_config(json.loads(last), "last config"))
            except (UserError, ValueError, TypeError):
                pass  # an old or broken saved config: start from the defaults
        self._form_loaded = self._form_key()

    def closeEvent(self, event) -> None:
        if not self.close_run():
            event.ignore()
            return
        self.hosts.secrets.close()  # a worker thread waiting on a password box: not connected; secrets go
        if self.run is not None:
            self.run.thread.wait(10_000)
        self.remember_form()
        self.settings.setValue("geometry", self.saveGeometry())
        self.settings.setValue("splitter", self.splitter.saveState())
        self.settings.setValue("runs_hidden_columns", ",".join(self.runs_table.hidden_columns()))
        self.timer.stop()
        self.idle_timer.stop()
        event.accept()
