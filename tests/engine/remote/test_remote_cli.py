"""`multilane devices --host` and every way a connection can fail, each one line, against a real sshd."""

from __future__ import annotations

import json
import socket
import subprocess
import time
from pathlib import Path

import pytest
from helpers import CLI
from sshd_server import MULTILANE, home_copy

pytestmark = pytest.mark.timeout(240)


def cli(env: dict, *args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL
    )


def one_error_line(p: subprocess.CompletedProcess) -> str:
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("multilane: error: "), p.stderr
    assert "Traceback" not in p.stderr
    return lines[0]


@pytest.mark.slow
def test_devices_on_a_host_lists_the_hosts_devices(sshd):
    p = cli(sshd.env(), "devices", "--host", "testhost", "--remote-command", MULTILANE, "--json")
    assert p.returncode == 0, p.stderr
    rows = json.loads(p.stdout)
    local = json.loads(cli(sshd.env(), "devices", "--json").stdout)
    assert [r["name"] for r in rows] == [r["name"] for r in local]  # the "host" is this machine
    # [user@]host[:port] works as well as an alias; the table is titled with the host
    user = subprocess.run(["id", "-un"], capture_output=True, text=True).stdout.strip()
    host = f"{user}@127.0.0.1:{sshd.port}"
    table = cli(sshd.env(), "devices", "--host", host, "--remote-command", MULTILANE)
    assert table.returncode == 0, table.stderr
    assert host in table.stdout and "cpu" in table.stdout


@pytest.mark.slow
def test_an_unknown_host_key_is_refused_until_the_user_trusts_its_fingerprint(sshd, tmp_path):
    env = home_copy(sshd, tmp_path / "home", known_hosts=None)
    line = one_error_line(cli(env, "devices", "--host", "testhost", "--remote-command", MULTILANE))
    assert "unknown host key" in line and "--trust-host-key SHA256:" in line
    fp = line.split("--trust-host-key ")[1].split()[0]
    expected = subprocess.run(
        ["ssh-keygen", "-l", "-f", str(sshd.dir / "host_key.pub")], capture_output=True, text=True
    )
    assert fp == expected.stdout.split()[1]  # the fingerprint OpenSSH itself shows
    assert not (tmp_path / "home" / ".ssh" / "known_hosts").exists()  # nothing trusted silently
    wrong = "SHA256:" + "A" * 43
    assert "unknown host key" in one_error_line(cli(env, "devices", "--host", "testhost", "--trust-host-key", wrong))
    ok = cli(env, "devices", "--host", "testhost", "--remote-command", MULTILANE, "--trust-host-key", fp, "--json")
    assert ok.returncode == 0, ok.stderr
    known = (tmp_path / "home" / ".ssh" / "known_hosts").read_text()
    assert known.split()[:3] == [f"[127.0.0.1]:{sshd.port}", *sshd.host_pub.split()[:2]]
    again = cli(env, "devices", "--host", "testhost", "--remote-command", MULTILANE, "--json")
    assert again.returncode == 0, again.stderr


def test_a_changed_host_key_is_refused(sshd, tmp_path):
    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    kind, b64 = Path(f"{other}.pub").read_text().split()[:2]
    env = home_copy(sshd, tmp_path / "home", known_hosts=f"[127.0.0.1]:{sshd.port} {kind} {b64}\n")
    fp = subprocess.run(["ssh-keygen", "-l", "-f", str(sshd.dir / "host_key.pub")], capture_output=True, text=True)
    args = ("devices", "--host", "testhost", "--remote-command", MULTILANE)
    line = one_error_line(cli(env, *args, "--trust-host-key", fp.stdout.split()[1]))  # never overrides a change
    assert "host key has CHANGED" in line and "refused" in line and "ssh-keygen" in line


def test_a_key_the_host_does_not_accept_is_one_line(sshd):
    line = one_error_line(cli(sshd.env(), "devices", "--host", "wrongkey", "--remote-command", MULTILANE))
    assert "authentication failed" in line and "authorized_keys" in line


@pytest.mark.slow
def test_a_host_that_does_not_answer_is_one_line_within_its_timeout(sshd, tmp_path):
    with socket.socket() as silent:  # accepts TCP (the kernel's backlog) but never says a word
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        extra = f"Host silent\n  HostName 127.0.0.1\n  Port {port}\n  ConnectTimeout 3\n"
        env = home_copy(sshd, tmp_path / "home", known_hosts="", extra_config=extra)
        t0 = time.monotonic()
        line = one_error_line(cli(env, "devices", "--host", "silent", timeout=60))
        took = time.monotonic() - t0
    assert "no answer within 3 s" in line
    assert took < 40  # its timeout (3 s) plus Python's start-up on a loaded machine, never a hang
    with socket.socket() as s:  # a closed port: refused at once
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    line = one_error_line(cli(env, "devices", "--host", f"127.0.0.1:{closed}"))
    assert "cannot connect" in line


def test_multilane_missing_on_the_host_says_how_to_install_it(sshd, tmp_path):
    missing = str(tmp_path / "no such dir" / "multilane")
    line = one_error_line(cli(sshd.env(), "devices", "--host", "testhost", "--remote-command", missing))
    assert "not found there" in line and "pip install multilane==" in line and "--remote-command" in line
    line = one_error_line(cli(sshd.env(), "devices", "--host", "testhost"))  # default: `multilane` on the login PATH
    assert "'multilane' not found there" in line


def test_multilane_of_another_version_on_the_host_is_named(sshd, tmp_path):
    old = tmp_path / "old-multilane"
    old.write_text("#!/bin/sh\necho multilane 0.0.1\n")
    old.chmod(0o755)
    line = one_error_line(cli(sshd.env(), "devices", "--host", "testhost", "--remote-command", str(old)))
    assert "is multilane 0.0.1, this computer runs 0.1.0" in line and "pip install multilane==0.1.0" in line


def test_a_malformed_host_is_one_line(sshd):
    line = one_error_line(cli(sshd.env(), "devices", "--host", "a b@c:d"))
    assert "[user@]host[:port]" in line
