"""Text from a run folder or a host is data in the window too: its control characters are shown escaped
(engine/display/terminal_text.py), in the status line, the message box and the host bar."""

from __future__ import annotations

from multilane.engine.display.terminal_text import printable

HOSTILE = "boom \x1b]0;pwned\x07\x1b[2J\u202eevil"


def test_a_hosts_messages_are_shown_escaped_in_the_window(make_window):
    w = make_window()
    w._on_finished({"status": "failed", "message": HOSTILE, "step": 3, "run_dir": ""})
    assert w.status_label.text() == f"Failed: {printable(HOSTILE)}"
    assert "\x1b" not in w.error_box.text() and printable(HOSTILE) in w.error_box.text()
    w._on_connection(f"reconnecting to h… {HOSTILE}")
    assert w.status_label.text() == printable(f"reconnecting to h… {HOSTILE}")
    w._host_devices(w.hosts.host, None, HOSTILE)  # a host that answered with that error
    assert w.hosts.message.text() == printable(HOSTILE)
