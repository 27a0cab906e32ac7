"""A host that trickles, floods, hangs or answers garbage (a real sshd on 127.0.0.1): every command has an
overall deadline and an output cap; one past either is killed there with its whole process group and
reported as what it was, in one line, never as a dropped connection."""

from __future__ import annotations

import subprocess
import time
import tracemalloc
from pathlib import Path

import psutil
import pytest
from helpers import CLI

pytestmark = pytest.mark.timeout(240)


def hostile(tmp_path: Path, mode: str) -> tuple[Path, Path]:
    """A ``--remote-command`` that answers ``--version`` as multilane does, then misbehaves: the script
    and the file where it writes its pid and its child's."""
    from multilane.engine import __version__

    pids = tmp_path / f"{mode}.pids"
    body = {
        "trickle": "while :; do printf x; sleep 0.2; done",
        "flood": "cat /dev/zero",
        "hang": "wait",
        "garbage": "printf 'garbage \\033]0;pwned\\007\\033[2J\\n'; exit 0",
    }[mode]
    script = tmp_path / f"{mode}-multilane"
    script.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = --version ]; then echo "multilane {__version__}"; exit 0; fi\n'
        + ("" if mode == "garbage" else f"echo $$ >> '{pids}'; sleep 300 & echo $! >> '{pids}'\n")
        + body
        + "\n"
    )
    script.chmod(0o755)
    return script, pids


def gone(pids: Path, timeout: float = 10.0) -> bool:
    """Every process named in ``pids`` has ended (a zombie awaiting its reaper counts as ended)."""
    wanted = [int(x) for x in pids.read_text().split()] if pids.exists() else []
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for pid in wanted:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return not alive
        time.sleep(0.1)


def wait_written(pids: Path, n: int = 2) -> None:
    deadline = time.monotonic() + 30
    while len(pids.read_text().split() if pids.exists() else []) < n and time.monotonic() < deadline:
        time.sleep(0.05)


@pytest.mark.parametrize("mode", ["trickle", "hang"])
def test_a_command_that_trickles_or_hangs_ends_at_its_overall_deadline_with_its_process_group(
    sshd, ssh_home, tmp_path, mode
):
    from multilane.engine.remote.connection import Connection, Disconnected, RemoteError

    script, pids = hostile(tmp_path, mode)
    with Connection("testhost", remote_command=str(script)) as conn:
        t0 = time.monotonic()
        with pytest.raises(RemoteError) as e:
            conn.multilane("devices --json", timeout_s=1.5)
        took = time.monotonic() - t0
        assert not isinstance(e.value, Disconnected)
        assert str(e.value) == f"testhost: '{script} devices --json' timed out after 1.5 s; stopped there"
        assert took < 1.5 + 5  # the deadline, then one short command that kills the group
        wait_written(pids)
        assert gone(pids), "the command or its child is still running on the host"
        assert conn.run("echo still usable") == (0, "still usable\n", "")  # the connection lives on


def test_a_command_that_floods_is_stopped_at_its_cap_in_bounded_memory(sshd, ssh_home, tmp_path):
    from multilane.engine.remote.connection import Connection, RemoteError

    script, pids = hostile(tmp_path, "flood")
    with Connection("testhost", remote_command=str(script)) as conn:
        tracemalloc.start()
        try:
            with pytest.raises(RemoteError) as e:
                conn.run(f"'{script}' devices", max_bytes=2 << 20, timeout_s=60)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert str(e.value).endswith("answered more than 2 MB; stopped there"), e.value
        assert peak < 8 << 20, f"{peak / 2**20:.1f} MB held for a 2 MB cap"
        wait_written(pids)
        assert gone(pids), "the flooding command is still running on the host"


def test_a_command_that_behaves_is_answered_byte_for_byte_with_its_exit_code(sshd, ssh_home):
    from multilane.engine.remote.connection import Connection

    with Connection("testhost") as conn:
        code, out, err = conn.run("printf 'a\\001b\\n'; printf 'warn\\n' >&2; exit 7", login=False)
        assert (code, out, err) == (7, "a\x01b\n", "warn\n")  # nothing of the wrapper shows
        assert conn.run("cat", stdin="secret") == (0, "secret", "")


@pytest.mark.slow
def test_devices_on_a_hostile_host_is_one_line_within_its_deadline_and_leaves_nothing_running(sshd, tmp_path):
    env = {**sshd.env(), "MULTILANE_REMOTE_TIMEOUT": "2", "MULTILANE_REMOTE_MAX_MB": "1"}
    expected = {
        "trickle": "timed out after 2 s; stopped there",
        "hang": "timed out after 2 s; stopped there",
        "flood": "answered more than 1 MB; stopped there",
        "garbage": "answered something that is not JSON",
    }
    for mode, words in expected.items():
        script, pids = hostile(tmp_path, mode)
        t0 = time.monotonic()
        p = subprocess.run(
            [*CLI, "devices", "--host", "testhost", "--remote-command", str(script)],
            capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, timeout=120,
        )  # fmt: skip
        took = time.monotonic() - t0
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1, (mode, p.stderr)
        assert lines[0].startswith("multilane: error: testhost: ") and words in lines[0], (mode, lines)
        assert "dropped" not in lines[0] and "\x1b" not in p.stderr + p.stdout, (mode, lines)
        assert took < 30, (mode, took)  # 2 s, plus Python's start-up on a loaded machine
        assert gone(pids), f"{mode}: left running on the host"


@pytest.mark.parametrize(
    ("answer", "words"),
    [
        ("garbage\x1b[2J", "something that is not JSON (Expecting value at 0; it began 'garbage\\\\x1b[2J')"),
        ('{"name": "cpu"}', "an object, not a list of devices"),
        ("[1]", "a wrong device list (device 0: should be an object, got 1)"),
        ('[{"kind": "tpu", "name": "x"}]', "a wrong device list (device 0: kind: input should be 'cuda' or 'cpu'"),
        ('[{"kind": "cpu", "name": "x", "util_pct": "hi"}]', "(device 0: util_pct: input should be a valid number"),
        ('[{"kind": "cpu", "name": "x", "cores": true}]', "(device 0: cores: input should be a valid integer"),
        ('[{"kind": "cpu"}]', "(device 0: name: field required"),
    ],
)
def test_a_devices_answer_of_the_wrong_shape_names_the_host_and_what_was_wrong(answer, words):
    from multilane.engine.remote.connection import RemoteError
    from multilane.engine.remote.devices_answer import check_devices

    with pytest.raises(RemoteError) as e:
        check_devices("gpu-box", answer)
    assert str(e.value).startswith("gpu-box: 'multilane devices --json' answered ") and words in str(e.value), e.value
    assert "\n" not in str(e.value) and "\x1b" not in str(e.value)


def test_a_devices_answer_keeps_its_rows_with_their_text_escaped():
    from multilane.engine.remote.devices_answer import check_devices

    rows = check_devices("h", '[{"kind": "cuda", "name": "cuda:0", "model": "H100\\u001b]0;x\\u0007", "util_pct": 5}]')
    assert rows == [{"kind": "cuda", "name": "cuda:0", "model": "H100\\x1b]0;x\\x07", "util_pct": 5.0}]


@pytest.mark.parametrize("argv", [["devices", "--host", ""], ["train", "--host", " ", "--task", "linear"],
                                  ["train", "--host", "=cpu:0"], ["sweep-worker", "--host", ""]])  # fmt: skip
def test_an_empty_host_is_refused_everywhere(argv, capsys):
    from multilane.engine.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2  # never this computer, silently
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "argument --host: an empty host; name an ssh config alias" in err[0], err


def test_a_runs_folder_holding_a_name_that_is_not_utf8_is_one_line(sshd, ssh_home):
    import os

    from multilane.engine.remote.connection import Connection, RemoteError
    from multilane.engine.remote.remote_runs import list_runs

    runs = sshd.runs / "not-utf8"
    runs.mkdir()
    os.mkdir(os.fsencode(runs) + b"/run-\xff")
    with Connection("testhost") as conn, pytest.raises(RemoteError) as e:
        list_runs(conn, str(runs))
    assert str(e.value) == f"testhost: the runs folder {runs} there holds a name that is not UTF-8; rename it"
