"""The main window's files: open, compare and resume runs, the runs table, presets, export."""

from __future__ import annotations

import json
from pathlib import Path

from multilane.engine.config import build_config, load_config, save_config
from multilane.engine.errors import UserError
from multilane.engine.rundir.runs_folder import run_folder_problem
from multilane.gui.export.export_dialog import ExportDialog
from multilane.gui.runs.run_data import RunData, config_lanes
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QFileDialog, QMessageBox


class RunFilesMixin:
    """Part of ``MainWindow`` (its attributes: plots, form, runs_table, settings, status_label, ...)."""

    def open_run(self, path: str, compare: bool = False, form: bool = True) -> bool:
        """Show a past run (its curves, its name, its settings in the form), or overlay it to compare.
        ``form=False``: the form stays as it is (a sweep's trial: the form is the next sweep's base)."""
        p = Path(path)
        problem = run_folder_problem(p)
        if problem:
            QMessageBox.warning(self, "Not a run folder", problem)
            return False
        if self.is_running():
            QMessageBox.information(self, "A run is in progress", "Stop the run before opening another one.")
            return False
        try:
            data = RunData.from_run_dir(p)
        except UserError as e:  # metrics.jsonl is a folder, or unreadable
            QMessageBox.warning(self, "Cannot open run", str(e))
            return False
        if compare:
            self.plots.add_overlay(data)
            names = [self.plots.data.name] + [r.name for r, _ in self.plots.overlays]
            self.plots.set_title("Comparing " + ", ".join(names))
        else:
            self.plots.reset(data)
            self.shown_run_dir = str(p)
            self._show_run_settings(p, ask=True, form=form)
            self.show_summary(str(p))
        self.plots.refresh()
        self.plots.fit_x()
        skipped = f" ({data.skipped} unreadable line{'s' if data.skipped != 1 else ''} skipped)" if data.skipped else ""
        self.status_label.setText(f"{'Comparing with' if compare else 'Viewing'} {p}{skipped}")
        return True

    def compare_runs(self, paths: list[str], form: bool = True) -> bool:
        """Show the first run and compare the others with it (the runs table's "Compare selected")."""
        if not paths or not self.open_run(paths[0], form=form):
            return False
        return all(self.open_run(p, compare=True) for p in paths[1:])

    def _tab_changed(self, index: int) -> None:
        """The runs table wants room for its columns: the left side widens while it is shown. The Sweep
        tab's settings want a little more than the Setup form; its trials are on the right (SweepTab.set_shown)."""
        tab = self.tabs.widget(index)
        sweep = getattr(self, "sweep_tab", None)
        if self._setup_sizes is not None:
            self.splitter.setSizes(self._setup_sizes)
            self._setup_sizes = None
        if tab in (self.runs_table, sweep):
            if tab is self.runs_table:
                self.refresh_runs()
            self._setup_sizes = self.splitter.sizes()
            total = sum(self._setup_sizes)
            want = min(760, total // 2) if tab is self.runs_table else min(560, int(total * 0.42))
            left = max(self._setup_sizes[0], want)
            self.splitter.setSizes([left, total - left])
        if sweep is not None:
            sweep.set_shown(tab is sweep)

    def refresh_runs(self) -> None:
        """Re-read the runs folder into the runs table."""
        self.runs_table.load(self._runs_dir())

    def _show_run_settings(self, run_dir: Path, ask: bool = False, form: bool = True) -> None:
        """The header names the run; the form shows the settings it ran with (not the last live run's).
        ``ask``: a form the user edited is replaced only if they agree (``ask_replace_form``); ``form=False``:
        never replaced."""
        title = run_dir.name
        try:
            cfg = build_config(json.loads((run_dir / "config.json").read_text(encoding="utf-8")), "run config")
        except (OSError, ValueError, UserError):
            cfg = None
        if cfg is not None:
            if form and (not ask or not self.form_edited() or self.ask_replace_form(run_dir.name)):
                self.set_config(cfg, keep_runs_dir=True)
            title += f" · {cfg.task.name} · {cfg.devices.use}"
        self.plots.set_title(title)

    def show_followed_settings(self, run_dir: Path) -> None:
        """Following a run: the greyed form shows the settings the followed run trains with (never the
        window's own, which said "steps off" beside "step 30/4,000"); the window's own come back when
        the follow ends. A run folder without a readable config.json leaves the form as it was."""
        try:
            cfg = build_config(json.loads((run_dir / "config.json").read_text(encoding="utf-8")), "run config")
        except (OSError, ValueError, UserError):
            return
        loaded = self._form_loaded  # whether the user had edited it stays as it was
        try:
            self._form_before_follow = build_config(self.config_dict(), "settings"), loaded
        except UserError:  # the user's form is not a valid config: it is kept as it is shown instead
            self._form_before_follow = (self.form.values(), self.devices.values()), loaded
        self.set_config(cfg, keep_runs_dir=True)
        self.form.setEnabled(False)
        self.devices.setEnabled(False)
        self.plots.data.set_devices(config_lanes(cfg.model_dump(mode="json")))

    def restore_form_after_follow(self) -> None:
        """The follow ended: the form shows the window's own settings again."""
        before, self._form_before_follow = getattr(self, "_form_before_follow", None), None
        if before is None:
            return
        form, loaded = before
        if isinstance(form, tuple):
            self.form.set_values(form[0])
            self.devices.set_values(form[1])
        else:
            self.set_config(form)
        self._form_loaded = loaded

    def open_tensorboard(self, path: str) -> bool:
        """Show a TensorBoard logdir's scalars (read-only), following it while it grows."""
        from multilane.gui.runs.tensorboard_view import TensorBoardView
        from multilane.integrations.tensorboard import TensorBoardLogdir

        if self.is_running():
            QMessageBox.information(self, "A run is in progress", "Stop the run before opening another one.")
            return False
        try:
            view = TensorBoardView(TensorBoardLogdir(path), self.plots, self)
        except (UserError, ImportError) as e:
            QMessageBox.warning(self, "Cannot open TensorBoard logdir", str(e))
            return False
        if getattr(self, "tensorboard_view", None) is not None:
            self.tensorboard_view.stop()
        self.tensorboard_view = view
        view.show()
        self.shown_run_dir = None  # exports go to the runs folder: nothing is written into the logdir
        self.plots.set_title(f"TensorBoard · {Path(path).name}")
        self.summary.show_records(view.records, f"TensorBoard · {Path(path).name}")  # this run's, not the last
        self.plots.fit_x()
        self.status_label.setText(f"Viewing TensorBoard logdir {path} (updates while it is written)")
        return True

    def open_tensorboard_dialog(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Open TensorBoard logdir (one run's folder)", self._runs_dir())
        if path:
            self.open_tensorboard(path)

    def open_run_dialog(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Open run folder", self._runs_dir())
        if path:
            self.open_run(path)

    def compare_dialog(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Compare with run folder", self._runs_dir())
        if path:
            self.open_run(path, compare=True)

    def resume_dialog(self) -> None:
        if self.hosts.host is not None:  # a host is picked: its run folders, listed over SSH
            self.remote_resume_dialog()
            return
        path = QFileDialog.getExistingDirectory(self, "Resume run folder", self._runs_dir())
        if path:
            self.resume(path)

    def resume(self, path: str) -> bool:
        """Continue a run from its last checkpoint, its earlier curves and settings shown."""
        if not self.start(resume_from=path):
            return False
        p = Path(path)
        if (p / "metrics.jsonl").exists():
            # The curves so far; the 'started' record cuts what came after the checkpoint.
            self.plots.reset(RunData.from_run_dir(p))
        self._show_run_settings(p)
        self.form.setEnabled(False)
        self.devices.setEnabled(False)
        return True

    def _runs_dir(self) -> str:
        return str(Path(self.form.values()["run"]["runs_dir"]).expanduser().resolve())

    def save_preset(self, path: str) -> None:
        save_config(build_config(self.config_dict(), "settings"), path)

    def load_preset(self, path: str) -> None:
        self.set_config(load_config(path))

    def save_preset_dialog(self) -> None:
        path, _ = QFileDialog.getSaveFileName(self, "Save preset", "preset.toml", "TOML (*.toml);;JSON (*.json)")
        if path:
            try:
                self.save_preset(path)
            except (UserError, OSError) as e:
                QMessageBox.warning(self, "Cannot save preset", str(e))

    def load_preset_dialog(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Load preset", "", "Config (*.toml *.json)")
        if path:
            try:
                self.load_preset(path)
            except UserError as e:
                QMessageBox.warning(self, "Cannot load preset", str(e))

    def export(
        self, out_dir: str, formats: list[str] | None = None, width: int = 1600, bundle: bool = False
    ) -> list[Path]:
        """Write the shown run's figures (as shown: smoothing, x axis, log y, compared runs) and CSV, here
        and now (scripts and tests; the window's own export runs in the background: ``export_in_background``)."""
        from multilane.gui.plots.export import export_run
        from multilane.gui.plots.figures import FigureOptions

        r = self._export_request(out_dir, formats, width, bundle)
        kw = {k: r[k] for k in ("run_dir", "compare", "bundle")}
        return export_run(r["run"], r["out_dir"], r["formats"], r["width"], options=FigureOptions(**r["options"]), **kw)

    def _export_request(self, out_dir: str, formats: list[str] | None, width: int, bundle: bool) -> dict:
        # no matplotlib imported here: the window's own export is made in another process (export_job.py)
        p = self.plots
        return {
            "run": p.data.snapshot(),  # records keep coming while the export runs
            "out_dir": out_dir,
            "formats": list(formats or ["png", "svg", "pdf", "csv"]),
            "width": width,
            "run_dir": self.shown_run_dir,
            "compare": [run.snapshot() for run, _ in p.overlays],
            "options": {"smoothing": p.smoothing, "x_mode": p.x_mode, "log_y": self.log_y.isChecked()},
            "bundle": bundle,
        }

    def export_in_background(
        self, out_dir: str, formats: list[str] | None = None, width: int = 1600, bundle: bool = False
    ):
        """The export in a process of its own, a progress bar with Cancel; the window stays in use.
        Returns the ``ExportJob`` (its ``finished`` signal carries the outcome)."""
        from multilane.gui.export.export_job import ExportJob

        job = ExportJob(self._export_request(out_dir, formats, width, bundle), self)
        job.finished.connect(self._export_finished)
        self.export_job = job
        self.note("Exporting in the background…", 600_000)
        return job

    def _export_finished(self, result: dict) -> None:
        if result["status"] == "error":
            text = f"{result['message']}\n\nThe run itself is untouched."
            self.error_box = QMessageBox(QMessageBox.Warning, "Export failed", text, parent=self)
            self.error_box.open()  # not exec(): the window goes on
            self.note("Export failed", 15_000)
        elif result["status"] == "cancelled":
            self.note("Export cancelled: nothing was written", 15_000)
        else:
            files = result["files"]
            self.note(f"Exported {len(files)} files to {files[0].parent}" if files else "Nothing exported", 15_000)

    def export_dialog(self, bundle: bool = False) -> ExportDialog:
        """One dialog: folder (in the run's folder to begin with), PNG width, formats."""
        start = Path(self.shown_run_dir) / "export" if self.shown_run_dir else Path(self._runs_dir()) / "export"
        width = self.settings.value("export_width", 1600, type=int)
        dialog = ExportDialog(str(start), width, bundle=bundle, parent=self)

        def accepted() -> None:
            self.settings.setValue("export_width", dialog.width.value())
            formats = dialog.chosen_formats()
            self.export_in_background(dialog.out_dir(), formats, dialog.width.value(), bundle=bundle)

        dialog.accepted.connect(accepted)
        dialog.open()  # not exec(): the plots keep redrawing while it is open
        self.export_box = dialog
        return dialog

    def export_bundle_dialog(self) -> ExportDialog:
        return self.export_dialog(bundle=True)

    def note(self, text: str, ms: int = 15_000) -> None:
        """A passing note at the status bar's right; the run's state on the left stays visible."""
        width = max(200, self.width() // 2)
        self.note_label.setText(self.note_label.fontMetrics().elidedText(text, Qt.ElideRight, width))
        self.note_label.setToolTip(text)
        self._note_timer.start(ms)
