"""An export that never freezes the window: its figures and CSV are made by a process of its own, with
a progress bar and Cancel.

matplotlib holds the GIL while it draws; a million points took ~95 s on a loaded machine, and the
window did not answer for as long when the export ran on the GUI thread. Here the GUI thread only
describes the run's columns (``export.write_request``: numpy buffers out of band); a Python thread
writes them to a private temporary file, starts ``export_child_main`` in a new process and reads its
progress lines; the window shows them. The process writes into a hidden folder beside the outputs, and
its files are moved into place only once all are made: a cancelled or failed export leaves the folder
as it was (an earlier export's files included).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import uuid
from pathlib import Path

from multilane.gui.runs.run_data import write_request  # not gui.plots.export: no matplotlib here
from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtWidgets import QProgressDialog, QWidget

CHILD = "import sys; from multilane.gui.plots.export import export_child_main; sys.exit(export_child_main(sys.argv[1]))"


class ExportJob(QObject):
    """One export in the background. ``finished`` carries ``{"status": "done" | "error" | "cancelled",
    "files": [Path, ...], "message": str}``; ``progressed`` ``(done, total, what)``."""

    progressed = Signal(int, int, str)
    finished = Signal(dict)

    def __init__(self, request: dict, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.out = Path(request["out_dir"])
        self.result: dict | None = None
        self._cancelled = threading.Event()
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._tmp = tempfile.mkdtemp(prefix="multilane-export-")  # private (0700): the request file
        self._staging = self.out / f".export-{uuid.uuid4().hex[:8]}"
        request = {**request, "out_dir": str(self._staging)}
        self.dialog = QProgressDialog("Exporting…", "Cancel", 0, 0, parent)
        self.dialog.setWindowTitle("Export")
        self.dialog.setWindowModality(Qt.WindowModality.NonModal)  # the window stays in use meanwhile
        self.dialog.setMinimumDuration(0)
        self.dialog.setAutoClose(False)
        self.dialog.setAutoReset(False)
        self.dialog.canceled.connect(self.cancel)
        self.progressed.connect(self._show_progress)
        self.finished.connect(self._done)
        self.dialog.show()
        self._thread = threading.Thread(target=self._work, args=(request,), name="multilane-export", daemon=True)
        self._thread.start()

    # -- the background thread ---------------------------------------------------------------------
    def _work(self, request: dict) -> None:
        result = {"status": "error", "files": [], "message": ""}
        try:
            path = os.path.join(self._tmp, "request.pickle")
            write_request(path, request)
            with self._lock:
                if self._cancelled.is_set():
                    raise _Cancelled
                self._proc = subprocess.Popen(
                    [sys.executable, "-c", CHILD, path],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    stdin=subprocess.DEVNULL,
                    text=True,
                    start_new_session=True,  # its own process group: Cancel ends it and nothing else
                )
            for line in self._proc.stdout:
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue
                if "progress" in msg:
                    self.progressed.emit(*msg["progress"])
                elif "done" in msg:
                    result = {"status": "done", "files": self._move_into_place(msg["done"]), "message": ""}
                elif "error" in msg:
                    result["message"] = msg["error"]
            self._proc.wait()
            if self._cancelled.is_set():
                raise _Cancelled
            if result["status"] != "done" and not result["message"]:
                result["message"] = f"export: its process ended with code {self._proc.returncode}"
        except _Cancelled:
            result = {"status": "cancelled", "files": [], "message": "Export cancelled"}
        except OSError as e:
            result["message"] = f"export: {e.strerror or e}"
        finally:
            shutil.rmtree(self._staging, ignore_errors=True)
            shutil.rmtree(self._tmp, ignore_errors=True)
        self.finished.emit(result)

    def _move_into_place(self, paths: list[str]) -> list[Path]:
        if self._cancelled.is_set():
            raise _Cancelled
        moved = []
        for p in paths:
            dest = self.out / Path(p).name
            os.replace(p, dest)
            moved.append(dest)
        return moved

    # -- the GUI thread ----------------------------------------------------------------------------
    def cancel(self) -> None:
        """End the export now: its process is stopped and what it made so far removed."""
        with self._lock:
            self._cancelled.set()
            if self._proc is not None and self._proc.poll() is None:
                try:
                    os.killpg(self._proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass

    def running(self) -> bool:
        return self.result is None

    def _show_progress(self, done: int, total: int, what: str) -> None:
        self.dialog.setMaximum(max(total, 1))
        self.dialog.setValue(min(done, total))
        self.dialog.setLabelText(f"Exporting {what}… ({done} of {total})" if what != "done" else "Finishing…")

    def _done(self, result: dict) -> None:
        self.result = result
        self.dialog.canceled.disconnect(self.cancel)
        self.dialog.close()


class _Cancelled(Exception):
    pass
