"""The main window's run: start it (in the app's worker thread or as a child process), follow a run
folder, pause, resume, stop, show what comes back, and what closing the window does to it."""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Any

from multilane.engine.config import PROCESS_STRATEGIES, RunConfig, build_config
from multilane.engine.display.progress import data_wait
from multilane.engine.display.terminal_text import printable
from multilane.engine.errors import UserError
from multilane.engine.rundir.follow import DIVERGED
from multilane.engine.rundir.runlog import CONFIG, RunDir, iter_metrics
from multilane.engine.rundir.runs_folder import run_folder_problem
from multilane.engine.rundir.writefile import check_writable
from multilane.engine.tasks.loader import TaskFileChanged, is_task_file
from multilane.gui.runs import follow
from multilane.gui.runs.redraw_pace import REDRAW_MS
from multilane.gui.runs.run_data import config_lanes
from multilane.gui.runs.run_summary import TrainingClock, fmt_duration
from multilane.gui.runs.worker import RunHandle, TrainWorker
from PySide6.QtWidgets import QFileDialog, QMessageBox

HOLD_MAX_S = 0.1  # the longest a redraw may hold training (it normally ends after the paint)
HOLD_WAIT_S = 0.02  # the longest the window waits for the step in progress before redrawing anyway


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


def final_text(status: str, step: int, message: str | None) -> str:
    """The status line at a run's end: "Stopped at step 1,219", with the message only where it says
    more than that (never "Stopped at step 1219 — stopped at step 1219")."""
    head = f"{status.capitalize()} at step {step:,}"
    if not message:
        return head
    said = {head.lower(), f"{status} at step {step}".lower()}
    if message.strip().rstrip(".").lower() in said:
        return head
    if message.lower().startswith(f"{status} at step"):
        return message[0].upper() + message[1:]
    return f"{head} — {message}"


def _rejected(message: str, task_file_changed: str | None = None) -> dict[str, Any]:
    out = {"status": "rejected", "message": message, "step": 0, "run_dir": "", "traceback": None}
    if task_file_changed:
        out["task_file_changed"] = task_file_changed
    return out


class RunControlMixin:
    """Part of ``MainWindow`` (its attributes: plots, form, devices, status_label, separate, ...)."""

    def is_running(self) -> bool:
        """A run is active from Start until its finished signal reaches the window."""
        return self._active

    def in_child_process(self, config: RunConfig | None, resume_from: str | None = None) -> bool:
        """Whether this run trains in a child process: the option, and always for ddp."""
        strategy = config.devices.strategy if config is not None else None
        if resume_from:
            strategy = ((RunDir(Path(resume_from)).read_json(CONFIG) or {}).get("devices") or {}).get("strategy")
        return strategy in PROCESS_STRATEGIES or self.separate.isChecked()

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
        if config is not None:
            try:  # at Start, not after the run's set-up (imports, data, model: seconds to minutes)
                check_writable(Path(config.run.runs_dir).expanduser(), create=False)
            except UserError as e:
                self._resume_from = None
                self._on_finished(_rejected(str(e)))
                return False
            if self.hosts.host is not None:  # on a host over SSH (gui/hosts/host_bar.py)
                return self.start_remote(config)
        if self.in_child_process(config, resume_from):
            try:  # the child process trains; this one follows its run folder
                worker = follow.start_child(config, resume_from, overrides)
            except UserError as e:  # an unwritable runs folder, a resume folder with no checkpoint
                changed = e.path if isinstance(e, TaskFileChanged) else None
                self._resume_from = resume_from
                self._on_finished(_rejected(str(e), changed))
                return False
        else:
            worker = TrainWorker(config, resume_from=resume_from, overrides=overrides)
        self._resume_from = resume_from
        self._begin(RunHandle(worker), config)
        if resume_from:  # the time it trained before: training time goes on from there
            try:
                self.clock = TrainingClock.of(iter_metrics(Path(resume_from) / "metrics.jsonl"))
            except UserError:
                pass
        self.remember_form()
        return True

    def follow_run(self, path: str) -> bool:
        """File > Follow run: show a run another process is writing, live (Pause/Stop via its control file)."""
        if self.is_running():
            return False
        if not Path(path).is_dir():
            QMessageBox.warning(self, "Not a run folder", run_folder_problem(path) or f"{path}: not a folder")
            return False
        self._resume_from = None
        self._begin(RunHandle(follow.follow(path)), None)
        self.show_followed_settings(Path(path))  # the form (greyed) shows the followed run's settings
        return True

    def follow_run_dialog(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Follow run folder", self._runs_dir())
        if path:
            self.follow_run(path)

    def _begin(self, handle: RunHandle, config: RunConfig | None) -> None:
        """Show a run from its start: one in this process's thread, or one another process writes."""
        self.plots.reset()
        if config is not None:  # each device's colour from the device list, before any record comes
            self.plots.data.set_devices(config_lanes(config.model_dump(mode="json")))
        self._last_train = {}
        self.clock = TrainingClock()
        self.hide_summary()
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
        self._set_running(True)
        self.status_label.setText(_starting_text(config, handle))
        self.run.start()

    def toggle_pause(self) -> None:
        if not self.is_running():
            return
        if self.paused:
            self.run.worker.resume()
        else:
            self.run.worker.pause()
        self._show_paused(not self.paused)

    def _show_paused(self, paused: bool) -> None:
        """The Pause button, the status line and the redraw hold follow the run's state, whoever paused
        it: this window, another one, ``multilane control``, or the run itself (``on_nonfinite = pause``)."""
        self.paused = paused
        self.pause_btn.setText("Resume" if paused else "Pause")

    def stop(self) -> None:
        if self.is_running():
            self.run.worker.stop()
            self.status_label.setText("Stopping after this step…")

    def _set_running(self, running: bool) -> None:
        for w in (self.pause_btn, self.stop_btn, self.pause_action, self.stop_action):
            w.setEnabled(running)
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
        task = [info["task"]] if info.get("task") else []
        self.plots.set_title(" · ".join([Path(info["run_dir"]).name, *task, ", ".join(info["devices"])]))

    def _on_record(self, rec: dict) -> None:
        self.plots.add_record(rec)
        self.clock.add(rec)
        kind = rec.get("kind")
        if kind == "train":
            self._last_train = rec
        elif kind == "event" and rec.get("event") in ("paused", "resumed", "started"):
            # A followed run replays its records from the start: the last of these says how it is now.
            self._show_paused(rec["event"] == "paused")
        elif kind == "telemetry":
            self.devices.update_from_telemetry(rec)
        elif kind == "event" and rec.get("event") == "warning":
            self.note(f"⚠ {printable(str(rec['message']))}", 30_000)
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
        if isinstance(result.get("message"), str):  # a run folder's or a host's text: data, escaped (terminal_text)
            result = {**result, "message": printable(result["message"])}
        if status == "rejected" and result.get("task_file_changed") and self._resume_from:
            self._ask_to_run_changed_task_file(self._resume_from, result)
        elif status == "rejected":
            self.status_label.setText(f"Not started: {result['message']}")
            if not result.get("cancelled"):  # the user's own Cancel (a password box) needs no warning box
                self.error_box = QMessageBox(QMessageBox.Warning, "Cannot start", result["message"], parent=self)
                self.error_box.open()
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
            text = final_text(status, result["step"], result.get("message"))
            self.status_label.setText(f"{text} · {result['run_dir']}")
        if status in ("finished", "stopped", "failed", DIVERGED) and result.get("run_dir"):
            self.show_summary(result["run_dir"])
        self.restore_form_after_follow()
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

    # -- the redraw hold and the status line -----------------------------------------------------------
    @property
    def hold_for_redraw(self) -> bool:
        """Run > Smooth window: training in the app's thread waits while the plots repaint."""
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
            # new one is taken. A run in another process shares no GIL: its control ignores holds.
            self._hold_pending = True
            self.run.control.hold(HOLD_MAX_S)
            self.run.control.wait_until_held(HOLD_WAIT_S)
        self._paced_refresh()
        if self.is_running() and self._last_train:
            self.status_label.setText(self.progress_text())

    def progress_text(self) -> str:
        """The status line while a run goes: paused, it says so, with no speed and no ETA."""
        r = self._last_train
        total = self.run_info.get("total_steps") or 0
        trained = fmt_duration(self.clock.seconds(None if self.paused else time.time()))
        where = f"step {r['step']:,}/{total:,} · epoch {r.get('epoch') or 0:.2f}"
        if self.paused:
            return f"Paused · {where} · training time {trained}"
        sps, tps = r.get("samples_per_s") or 0, r.get("tokens_per_s")
        step_ms = r.get("step_ms") or 0
        eta = (total - r["step"]) * step_ms / 1000 if step_ms else 0
        speed = f"{sps:,.0f} samples/s" + (f" · {tps:,.0f} tokens/s" if isinstance(tps, (int, float)) else "")
        return f"{where} · {speed}{data_wait(r)} · training time {trained} · ETA {fmt_duration(eta)}"

    def _paced_refresh(self) -> None:
        """Refresh the plots; while a run trains, the next refresh comes when the redraw pace allows
        (gui/runs/redraw_pace.py: the plots' redraws take at most a small share of the machine's CPU)."""
        dirty = self.plots.dirty
        t0 = time.perf_counter()
        self.plots.refresh()
        cost = time.perf_counter() - t0 + self.plots.paint_s  # this refresh, and the paint of the last
        self.plots.paint_s = 0.0
        if dirty or cost > 0.001:
            self.redraw_pace.add(cost)
        interval = self.redraw_pace.interval_ms() if self.is_running() else REDRAW_MS
        if interval != self.timer.interval():
            self.timer.setInterval(interval)

    def _release_hold(self) -> None:
        self._hold_pending = False
        if self.run is not None:
            self.run.control.release()

    # -- closing ---------------------------------------------------------------------------------------
    def confirm_close(self) -> str:
        """Ask what to do with the running run: "stop", "keep" (a child process trains on) or "cancel"."""
        box = QMessageBox(QMessageBox.Question, "A run is in progress", "", parent=self)
        stop = box.addButton("Stop and quit", QMessageBox.AcceptRole)
        keep = None
        if self.run is not None and self.run.child is not None:
            box.setText(
                "The run trains in its own process. Stop it (it finishes its step and saves a checkpoint), "
                "or let it train on without the window? (File → Follow run shows it again.)"
            )
            keep = box.addButton("Keep training and quit", QMessageBox.ActionRole)
        else:
            box.setText("Stop the run (it finishes its step and saves a checkpoint) and quit?")
        box.addButton(QMessageBox.Cancel)
        box.setDefaultButton(stop)
        box.exec()
        clicked = box.clickedButton()
        return "stop" if clicked is stop else "keep" if keep is not None and clicked is keep else "cancel"

    def close_run(self) -> bool:
        """What closing the window does to a run (docs/app.md): False when the user cancels."""
        if not self.is_running():
            return True
        if self.run.followed:  # someone else's run: stop showing it, it goes on
            self.run.detach()
            return True
        answer = self.confirm_close()
        if answer == "cancel":
            return False
        if answer == "keep" and self.run.child is not None:
            self.run.detach()
            return True
        self.status_label.setText("Stopping…")
        self.run.stop_and_wait()
        return True


def _starting_text(config: RunConfig | None, handle: RunHandle) -> str:
    """What the status bar says at Start: a task file that is about to run is named in full."""
    where = " in a separate process" if handle.child is not None else ""
    if config is not None and is_task_file(config.task.name):
        return f"Starting{where}… running task file {Path(config.task.name).expanduser().resolve()}"
    return "Following…" if handle.followed else f"Starting{where}…"
