"""A real OpenSSH server on 127.0.0.1 for the remote tests: its own host key, ``authorized_keys`` and a
temporary HOME holding ``~/.ssh/config``, the client's keys and ``known_hosts`` (the Python SSH library
reads ``$HOME``). The "remote" is this machine: its ``multilane`` is this venv's, its runs go in a
temporary folder. One server per test module keeps the suite quick."""

from __future__ import annotations

import getpass
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
MULTILANE = str(Path(sys.executable).with_name("multilane"))


@dataclass
class SshServer:
    port: int
    home: Path
    dir: Path
    host_pub: str
    proc: subprocess.Popen
    runs: Path
    alias: str = "testhost"

    def env(self) -> dict[str, str]:
        """The environment of a CLI run against this server (its HOME holds ~/.ssh)."""
        env = {k: v for k, v in os.environ.items() if k != "SSH_AUTH_SOCK"}
        env["HOME"] = str(self.home)
        return env

    def session_processes(self) -> list[psutil.Process]:
        """sshd's per-connection processes (killing one cuts that connection)."""
        try:
            return psutil.Process(self.proc.pid).children(recursive=False)
        except psutil.NoSuchProcess:
            return []

    def stop(self) -> None:
        """The server goes away: no new connection, and every open one is cut."""
        sessions = self.session_processes()
        self.proc.terminate()
        self.proc.wait(10)
        for p in sessions:
            p.kill()
        psutil.wait_procs(sessions, timeout=10)

    def start(self) -> None:
        """The server is back, on the same port with the same keys."""
        self.proc = spawn_sshd(self.dir, self.port)

    def cut_connections(self) -> int:
        procs = self.session_processes()
        for p in procs:
            p.send_signal(signal.SIGKILL)
        psutil.wait_procs(procs, timeout=10)
        return len(procs)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def keygen(path: Path) -> str:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    return path.with_suffix(".pub").read_text().strip() if path.suffix else Path(f"{path}.pub").read_text().strip()


def spawn_sshd(d: Path, port: int) -> subprocess.Popen:
    """sshd in the foreground on ``port``, once it answers with its banner."""
    with open(d / "sshd.log", "ab") as log:
        proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(d / "sshd_config")], stderr=log)
    deadline = time.monotonic() + 20
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                if s.recv(4).startswith(b"SSH-"):
                    return proc
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"sshd did not start: {(d / 'sshd.log').read_text()[-500:]}")
        time.sleep(0.1)


def start_sshd(base: Path) -> SshServer:
    if not Path(SSHD).exists():
        pytest.fail("sshd is not installed (apt-get install -y openssh-server; .ci/run does it)")
    d = base / "sshd"
    d.mkdir()
    host_pub = keygen(d / "host_key")
    home = base / "home"
    (home / ".ssh").mkdir(parents=True, mode=0o700)
    client_pub = keygen(home / ".ssh" / "id_test")
    keygen(home / ".ssh" / "id_wrong")
    (d / "authorized_keys").write_text(client_pub + "\n")
    port = free_port()
    Path("/run/sshd").mkdir(exist_ok=True)  # OpenSSH's privilege separation directory
    options = {
        "ListenAddress": "127.0.0.1",
        "Port": str(port),
        "HostKey": str(d / "host_key"),
        "AuthorizedKeysFile": str(d / "authorized_keys"),
        "PidFile": str(d / "sshd.pid"),
        "UsePAM": "no",
        "StrictModes": "no",
        "PasswordAuthentication": "no",
        "KbdInteractiveAuthentication": "no",
        "PermitRootLogin": "prohibit-password",
        "Subsystem": "sftp internal-sftp",
        "MaxStartups": "100",
        "LogLevel": "ERROR",
    }
    (d / "sshd_config").write_text("".join(f"{k} {v}\n" for k, v in options.items()))
    proc = spawn_sshd(d, port)
    user = getpass.getuser()
    (home / ".ssh" / "config").write_text(
        f"Host testhost\n  HostName 127.0.0.1\n  Port {port}\n  User {user}\n"
        f"  IdentityFile ~/.ssh/id_test\n  IdentitiesOnly yes\n\n"
        f"Host wrongkey\n  HostName 127.0.0.1\n  Port {port}\n  User {user}\n"
        f"  IdentityFile ~/.ssh/id_wrong\n  IdentitiesOnly yes\n\n"
        f"Host 127.0.0.1\n  IdentityFile ~/.ssh/id_test\n  IdentitiesOnly yes\n"
    )
    kind, b64 = host_pub.split()[:2]
    (home / ".ssh" / "known_hosts").write_text(f"[127.0.0.1]:{port} {kind} {b64}\n")
    runs = base / "remote-runs"
    runs.mkdir()
    return SshServer(port, home, d, host_pub, proc, runs)


def home_copy(server: SshServer, dest: Path, known_hosts: str | None = None, extra_config: str = "") -> dict[str, str]:
    """The environment of a client whose HOME is a copy of the server's client home, with another
    ``known_hosts`` (None: none at all) and more ``~/.ssh/config``."""
    shutil.copytree(server.home, dest)
    kh = dest / ".ssh" / "known_hosts"
    if known_hosts is None:
        kh.unlink()
    else:
        kh.write_text(known_hosts)
    if extra_config:
        cfg = dest / ".ssh" / "config"
        cfg.write_text(cfg.read_text() + "\n" + extra_config)
    return {**server.env(), "HOME": str(dest)}


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    server = start_sshd(tmp_path_factory.mktemp("ssh"))
    yield server
    server.proc.terminate()
    try:
        server.proc.wait(10)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait()
    for p in server.session_processes():
        p.kill()


@pytest.fixture
def ssh_home(sshd, monkeypatch):
    """This process's HOME (the SSH library reads ~/.ssh from it) is the server's client home."""
    monkeypatch.setenv("HOME", str(sshd.home))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    return sshd.home


def add_host_alias(server: SshServer, alias: str) -> None:
    """Another ``Host`` alias of this same server in ``~/.ssh/config``: a second "host" for the tests of a
    run across hosts (each alias gets its own runs folder there)."""
    cfg = server.home / ".ssh" / "config"
    text = cfg.read_text()
    if f"Host {alias}\n" in text:
        return
    block = text[text.index("Host testhost\n") : text.index("Host wrongkey\n")]
    cfg.write_text(text + "\n" + block.replace("Host testhost\n", f"Host {alias}\n"))


def remote_window(make_window, qtbot, runs: Path, host: str = "testhost"):
    """A main window (tests/gui) with ``host`` picked, its command and runs folder set, its devices read."""
    w = make_window()
    w.hosts.combo.setCurrentText(host)
    w.hosts.command.setText(MULTILANE)
    w.hosts.runs.setText(str(runs))
    w.hosts.command.editingFinished.emit()
    w.hosts.read_devices(host)  # again, now with the command set
    qtbot.waitUntil(lambda: w.hosts.message.text() == f"devices of {host}", timeout=240_000)
    return w
