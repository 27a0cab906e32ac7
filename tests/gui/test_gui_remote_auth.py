"""The window and a key with a passphrase, on a real sshd on 127.0.0.1: picking the host asks for the
passphrase in a password box (the worker thread waits, the window does not), the answer connects, and
it is kept in memory only: never in the settings, the runs folder, the mirror or the run there."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from sshd_locked import PASSPHRASE, lock_key
from sshd_server import MULTILANE

pytestmark = pytest.mark.timeout(900)


def pick_locked_host(make_window, sshd, tmp_path):
    from PySide6.QtCore import QSettings

    host = lock_key(sshd)
    settings = QSettings(str(tmp_path / "settings.ini"), QSettings.IniFormat)
    settings.setValue(f"remote/command/{host}", MULTILANE)  # remembered: picking the host reads its devices
    settings.setValue(f"remote/runs/{host}", str(sshd.runs))
    settings.sync()
    w = make_window()
    w.hosts.combo.setCurrentText(host)
    return w, host


def the_box(qtbot, w):
    qtbot.waitUntil(lambda: w.hosts.secrets.box is not None and w.hosts.secrets.box.isVisible(), timeout=120_000)
    return w.hosts.secrets.box


def files_holding(root: Path, secret: bytes) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and secret in p.read_bytes()]


@pytest.mark.slow
def test_a_passphrase_is_asked_in_the_window_connects_and_is_written_nowhere(
    ssh_home, sshd, make_window, qtbot, tmp_path
):
    from PySide6.QtWidgets import QLineEdit

    w, host = pick_locked_host(make_window, sshd, tmp_path)
    box = the_box(qtbot, w)
    assert box.textEchoMode() == QLineEdit.Password and "passphrase" in box.labelText()
    assert w.hosts.message.text() == f"reading the devices of {host}…"  # the window is live meanwhile
    box.setTextValue(PASSPHRASE)
    box.accept()
    qtbot.waitUntil(lambda: w.hosts.message.text() == f"devices of {host}", timeout=120_000)
    assert w.devices.host == host and [d.name for d in w.devices.selected()] == ["cpu:0", "cpu:1"]
    assert w.hosts.secrets.asked == 1

    # Start there and follow: the same session's secret connects, no second question; a connection
    # cut mid-run reconnects with it, no question either
    w.form.set_task("linear")
    w.form.editors["train.steps"].widget.setValue(10_000_000)
    w.form.editors["train.log_every"].widget.setValue(5)
    w.form.editors["train.eval_every"].widget.setValue(0)
    assert w.start()
    qtbot.waitUntil(lambda: w.plots.data.last_step > 20, timeout=300_000)
    assert sshd.cut_connections() >= 1
    seen = w.plots.data.last_step
    qtbot.waitUntil(lambda: w.plots.data.last_step > seen + 100, timeout=300_000)  # followed again
    w.stop()
    qtbot.waitUntil(lambda: not w.is_running(), timeout=240_000)
    assert w.last_result["status"] == "stopped" and w.hosts.secrets.asked == 1
    mirror = Path(w.shown_run_dir)
    assert (mirror / "remote.json").exists()

    # Start when the secret is not known (say, a window opened later): asked; Cancel is one line, no box
    w.hosts.secrets.forget(host)
    assert w.start()
    the_box(qtbot, w).reject()
    qtbot.waitUntil(lambda: not w.is_running(), timeout=60_000)
    line = f"Not started: {host}: no password or passphrase given; not connected"
    assert w.status_label.text() == line and getattr(w, "error_box", None) is None and w.hosts.secrets.asked == 2

    w.settings.sync()
    secret = PASSPHRASE.encode()
    assert secret not in (tmp_path / "settings.ini").read_bytes()
    assert files_holding(tmp_path / "runs", secret) == []  # the local runs folder and the mirror in it
    assert files_holding(sshd.runs, secret) == []  # the run folder there (its config, console.log)


@pytest.mark.slow
def test_cancel_is_one_line_and_asks_no_more(ssh_home, sshd, make_window, qtbot, tmp_path):
    w, host = pick_locked_host(make_window, sshd, tmp_path)
    the_box(qtbot, w).reject()
    line = f"{host}: no password or passphrase given; not connected"
    qtbot.waitUntil(lambda: w.hosts.message.text() == line, timeout=60_000)
    assert w.devices.selected() == [] and not w.start_btn.isEnabled()
    end = time.monotonic() + 3
    while time.monotonic() < end:  # no retry loop: no second box
        qtbot.wait(100)
        assert w.hosts.secrets.box is None
    assert w.hosts.secrets.asked == 1

    # a wrong passphrase: one line too, and it is not kept (the next attempt asks again)
    w.hosts.read_devices(host)
    box = the_box(qtbot, w)
    box.setTextValue("not the passphrase")
    box.accept()
    qtbot.waitUntil(lambda: w.hosts.message.text() != line, timeout=60_000)
    assert "the password or passphrase was not accepted" in w.hosts.message.text(), w.hosts.message.text()
    assert "\n" not in w.hosts.message.text()
    w.hosts.read_devices(host)
    the_box(qtbot, w).reject()
    qtbot.waitUntil(lambda: w.hosts.message.text() == line, timeout=60_000)
    assert w.hosts.secrets.asked == 3


def test_closing_the_window_while_the_box_is_open_ends_the_wait(ssh_home, sshd, make_window, qtbot, tmp_path):
    import threading

    w, _ = pick_locked_host(make_window, sshd, tmp_path)
    the_box(qtbot, w)
    waiting = [t for t in threading.enumerate() if t.name == "multilane-host-devices"]
    assert waiting
    w.close()
    for t in waiting:
        t.join(30)
        assert not t.is_alive()
