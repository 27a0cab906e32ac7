"""The Sweep tab's "Workers on hosts", offscreen, with a real sshd and a real PostgreSQL on 127.0.0.1: a
sweep whose study is in PostgreSQL, a worker started on a host of the window's host list from the tab,
its trials in the table with the host's name, Stop worker re-queueing its running trial, which the
local sweep then finishes; a study in a local file cannot be offered to a host (one line)."""

import sys
from pathlib import Path

import pytest
from PySide6.QtCore import Qt
from sshd_server import MULTILANE

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine" / "sweep"))
from postgres import pg_bin, postgres_server

pytestmark = [
    pytest.mark.timeout(1800),
    pytest.mark.skipif(pg_bin("initdb") is None, reason="PostgreSQL not installed (.ci/run installs it)"),
]


@pytest.mark.slow
def test_the_sweep_tab_starts_a_worker_on_a_host_shows_its_trials_and_stops_it(
    ssh_home, sshd, make_window, qtbot, tmp_path
):
    w = make_window(("cpu:0",))
    w.form.set_task("digits")
    for key, value in (("train.steps", 60), ("train.log_every", 5), ("train.eval_every", 5)):
        w.form.editors[key].widget.setValue(value)
    w.hosts.settings.setValue("remote/command/testhost", MULTILANE)  # multilane's command on that host
    w.hosts.settings.setValue("remote/runs/testhost", str(sshd.runs))  # and its runs folder there
    tab = w.sweep_tab
    w.tabs.setCurrentWidget(tab)
    tab.trials.setValue(4)
    tab.folder.setText(str(tmp_path / "sweeps"))
    tab.pruner.setCurrentText("none")
    workers = tab.workers
    assert "testhost" in workers.hosts()

    workers.storage.setText("sqlite:///here.db")  # a file on this computer: no worker on a host for it
    workers.refresh()
    assert not workers.start_btn.isEnabled() and "SQLite" in workers.message.text()
    assert not workers.start_worker("testhost", "cpu:1")

    with postgres_server() as url:
        workers.storage.setText(url)
        workers.refresh()
        assert not workers.start_btn.isEnabled() and "start the sweep" in workers.message.text()
        assert tab.start()
        try:
            _start_watch_and_stop_a_worker(tab, workers, qtbot, sshd)
        finally:
            for e in workers.entries:
                if e["state"] == "running":
                    from multilane.engine.remote.sweep_worker import stop_worker

                    stop_worker(e["conn"], e["worker"].pid, grace_s=30)
            workers.close_connections()
            tab.timer.stop()  # the database goes away with the block: no poll of it after
            if tab.process is not None and tab.process.running():
                tab.process.proc.kill()  # its trials die with it (PR_SET_PDEATHSIG)
                tab.process.proc.wait(30)


def _start_watch_and_stop_a_worker(tab, workers, qtbot, sshd):
    qtbot.waitUntil(lambda: (tab.poll(), tab.sweep is not None)[1], timeout=300_000)
    assert tab.sweep.storage_url.startswith("postgresql")
    tab.poll()
    assert workers.start_btn.isEnabled(), workers.message.text()
    workers.host.setCurrentText("testhost")
    workers.devices.setText("cpu:1")
    qtbot.mouseClick(workers.start_btn, Qt.LeftButton)
    qtbot.waitUntil(lambda: bool(workers.entries), timeout=120_000)
    assert workers.list.item(0).text().startswith("testhost · cpu:1 · pid ")
    assert workers.list.item(0).text().endswith(" · running")

    def host_trial_training():
        tab.poll()
        return any(r["host"] == "testhost" and r["state"] == "running" and (r["step"] or 0) >= 5 for r in tab._rows)

    qtbot.waitUntil(host_trial_training, timeout=600_000)
    headers = [tab.table.horizontalHeaderItem(c).text() for c in range(tab.table.columnCount())]
    col = headers.index("host")
    assert "testhost" in {tab.table.item(r, col).text() for r in range(tab.table.rowCount())}

    workers.list.setCurrentRow(0)
    assert workers.stop_btn.isEnabled()
    qtbot.mouseClick(workers.stop_btn, Qt.LeftButton)
    qtbot.waitUntil(lambda: workers.entries[0]["state"] == "stopped", timeout=300_000)
    assert "stopped" in workers.message.text()

    # The local sweep carries on to the count, the stopped worker's trial re-run here.
    qtbot.waitUntil(lambda: (tab.poll(), not tab.running())[1], timeout=900_000)
    tab.poll()
    states = [r["state"] for r in tab._rows]
    log = Path(workers.entries[0]["worker"].log).read_text()  # the host is this machine
    assert states.count("complete") == 4 and "running" not in states, (tab._rows, log)
    lost = [r for r in tab._rows if r["state"] == "lost"]
    assert lost and all(r["host"] == "testhost" for r in lost)
    assert all(r["run_dir"].startswith(str(sshd.runs)) for r in lost)
