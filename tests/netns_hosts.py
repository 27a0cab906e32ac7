"""Two hosts with their own addresses for the remote tests: two network namespaces made by the test, joined
by a veth pair (10.77.0.1 and 10.77.0.2; the addresses live inside the namespaces, so they clash with
nothing), an sshd in each on its own port 22. This computer reaches each sshd through a ``ProxyCommand``
that enters the namespace (``ip netns exec NS python relay``), so cutting the link between the two
hosts (``ip link set ... down``) leaves this computer's sessions to both alive. Names are unique per
fixture (safe beside other tests and other workers); everything is removed at the end.

Needs root and ``ip netns`` (iproute2); otherwise the fixture skips with the reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from sshd_server import MULTILANE, SSHD, SshServer

ADDRESSES = ("10.77.0.1", "10.77.0.2")

RELAY = r"""
import os, selectors, socket, sys
s = socket.create_connection(("127.0.0.1", 22), 10)
sel = selectors.DefaultSelector()
sel.register(0, selectors.EVENT_READ)
sel.register(s, selectors.EVENT_READ)
while True:
    for key, _ in sel.select():
        if key.fileobj == 0:
            data = os.read(0, 65536)
            if not data:
                s.shutdown(socket.SHUT_WR)
                sel.unregister(0)
                continue
            s.sendall(data)
        else:
            data = s.recv(65536)
            if not data:
                sys.exit(0)
            os.write(1, data)
"""


@dataclass
class NetnsHosts:
    names: tuple[str, str]  # the namespaces
    links: tuple[str, str]  # each host's end of the veth pair, inside its namespace
    aliases: tuple[str, str]  # the ssh config aliases
    commands: tuple[str, str]  # the --remote-command (multilane with GLOO_SOCKET_IFNAME set to the host's link)
    runs: tuple[Path, Path]
    procs: list[subprocess.Popen]

    def ns(self, k: int, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.names[k], *cmd], capture_output=True, text=True, check=check)

    def link(self, k: int, up: bool) -> None:
        """Host ``k``'s end of the link up or down (``down``: the other host no longer reaches it)."""
        self.ns(k, "ip", "link", "set", self.links[k], "up" if up else "down")

    def pids(self, k: int) -> list[int]:
        """Every process in host ``k``'s namespace (its sshd, sessions, launchers, ranks)."""
        out = subprocess.run(["ip", "netns", "pids", self.names[k]], capture_output=True, text=True).stdout
        return [int(x) for x in out.split()]


def _ip(*args: str) -> None:
    p = subprocess.run(["ip", *args], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {p.stderr.strip()}")


def can_make_namespaces() -> str | None:
    """None when ``ip netns`` works here, else the reason it does not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "ip (iproute2) is not installed"
    name = f"mlprobe{uuid.uuid4().hex[:8]}"
    p = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if p.returncode != 0:
        return f"ip netns add failed: {p.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def start_netns_hosts(server: SshServer, base: Path) -> NetnsHosts:
    tag = uuid.uuid4().hex[:6]
    names = (f"ml{tag}a", f"ml{tag}b")
    links = (f"mlv{tag}a", f"mlv{tag}b")
    hosts = NetnsHosts(names, links, (f"ns{tag}a", f"ns{tag}b"), ("", ""), (base / "a", base / "b"), [])
    for n in names:
        _ip("netns", "add", n)
    _ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
    commands = []
    relay = base / "relay.py"
    relay.write_text(RELAY)
    cfg = server.home / ".ssh" / "config"
    known = server.home / ".ssh" / "known_hosts"
    kind, b64 = server.host_pub.split()[:2]
    for k, (n, link, addr) in enumerate(zip(names, links, ADDRESSES, strict=True)):
        _ip("link", "set", link, "netns", n)
        hosts.ns(k, "ip", "link", "set", "lo", "up")
        hosts.ns(k, "ip", "addr", "add", f"{addr}/24", "dev", link)
        hosts.ns(k, "ip", "link", "set", link, "up")
        d = base / f"sshd-{k}"
        d.mkdir(parents=True)
        conf = (server.dir / "sshd_config").read_text()
        conf = "".join(
            line + "\n" for line in conf.splitlines() if not line.startswith(("ListenAddress", "Port ", "PidFile"))
        )
        (d / "sshd_config").write_text(conf + f"ListenAddress 0.0.0.0\nPort 22\nPidFile {d / 'sshd.pid'}\n")
        log = open(d / "sshd.log", "ab")  # noqa: SIM115 (the server's own log, open while it runs)
        hosts.procs.append(
            subprocess.Popen(["ip", "netns", "exec", n, SSHD, "-D", "-e", "-f", str(d / "sshd_config")], stderr=log)
        )
        command = base / "multilane"  # each host's login environment: Gloo on its end of the link
        command.write_text(
            f"#!/bin/sh\nfor i in /sys/class/net/mlv{tag}*; do export GLOO_SOCKET_IFNAME=${{i##*/}}; done\n"
            f'exec {MULTILANE} "$@"\n'
        )
        command.chmod(0o755)
        commands.append(str(command))
        hosts.runs[k].mkdir(parents=True)
        with open(cfg, "a") as f:
            f.write(
                f"\nHost {hosts.aliases[k]}\n  HostName {addr}\n  User root\n  IdentityFile ~/.ssh/id_test\n"
                f"  IdentitiesOnly yes\n  ProxyCommand ip netns exec {n} {sys.executable} {relay}\n"
            )
        with open(known, "a") as f:
            f.write(f"{addr} {kind} {b64}\n")
    hosts.commands = (commands[0], commands[1])
    deadline = time.monotonic() + 30
    for k in (0, 1):  # each sshd answers its banner inside its namespace
        probe = "import socket; s = socket.create_connection(('127.0.0.1', 22), 1); assert s.recv(4) == b'SSH-'"
        while hosts.ns(k, sys.executable, "-c", probe, check=False).returncode != 0:
            if time.monotonic() > deadline or hosts.procs[k].poll() is not None:
                stop_netns_hosts(hosts)
                pytest.fail(f"sshd in {names[k]} did not start")
            time.sleep(0.2)
    return hosts


def stop_netns_hosts(hosts: NetnsHosts) -> None:
    """Every process in either namespace ended, then the namespaces (and the veth pair) removed."""
    for k in (0, 1):
        for pid in hosts.pids(k):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
    for p in hosts.procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
    for n in hosts.names:
        subprocess.run(["ip", "netns", "del", n], capture_output=True)


@pytest.fixture(scope="module")
def netns_hosts(sshd, tmp_path_factory):
    reason = can_make_namespaces()
    if reason:
        pytest.skip(f"two hosts with their own addresses: {reason}")
    hosts = start_netns_hosts(sshd, tmp_path_factory.mktemp("netns"))
    yield hosts
    stop_netns_hosts(hosts)
