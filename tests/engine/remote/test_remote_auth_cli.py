"""The CLI and a key with a passphrase (a real sshd on 127.0.0.1): on a terminal the passphrase is asked
(not echoed) and connects; without a terminal, or with a wrong one, one line."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import time

import pytest
from helpers import CLI
from sshd_locked import PASSPHRASE, lock_key
from sshd_server import MULTILANE

pytestmark = pytest.mark.timeout(240)


def on_a_terminal(env: dict, args: list[str], answer: str, timeout: float = 120) -> tuple[int, str]:
    """Run the CLI with a pseudo-terminal as its controlling terminal; type ``answer`` at the prompt."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: its terminal is the pty
        try:
            os.execvpe(CLI[0], [*CLI, *args], env)
        finally:
            os._exit(127)
    out, typed = b"", False
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.5)
            if not ready:
                continue
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # the child closed the terminal: it ended
                break
            if not chunk:
                break
            out += chunk
            if not typed and b"passphrase" in out and out.rstrip().endswith(b":"):
                os.write(fd, answer.encode() + b"\n")
                typed = True
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(fd)
    return os.waitstatus_to_exitcode(status), out.decode(errors="replace")


@pytest.mark.slow
def test_the_cli_asks_for_the_passphrase_on_a_terminal_and_connects(sshd, tmp_path):
    host = lock_key(sshd)
    args = ["devices", "--host", host, "--remote-command", MULTILANE, "--json"]
    code, out = on_a_terminal(sshd.env(), args, PASSPHRASE)
    assert code == 0, out
    assert "password or key passphrase for" in out and PASSPHRASE not in out  # asked, not echoed
    rows = json.loads(out[out.index("[") :])
    local = json.loads(subprocess.run([*CLI, "devices", "--json"], capture_output=True, text=True).stdout)
    assert [r["name"] for r in rows] == [r["name"] for r in local]  # the "host" is this machine

    code, out = on_a_terminal(sshd.env(), args, "wrong")
    assert code == 2 and out.strip().splitlines()[-1].startswith("multilane: error: ")
    assert "the password or passphrase was not accepted" in out and "Traceback" not in out

    # no terminal: nothing asked, one line
    p = subprocess.run(
        [*CLI, *args], capture_output=True, text=True, env=sshd.env(), stdin=subprocess.DEVNULL, timeout=120
    )
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "authentication failed" in p.stderr
