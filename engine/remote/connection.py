"""One SSH connection to a host: the user's OpenSSH config, keys, agent and known_hosts, and one clear
line for everything that can go wrong (unknown or changed host key, refused key, no answer, no
``multilane`` there).

An unknown host key is never trusted silently: ``trust`` names the fingerprint the user checked (the
CLI's ``--trust-host-key``, the app's question); only then is the key added to ``known_hosts``. A
changed key is always refused. A password or key passphrase is asked through ``ask`` when one is
needed and is kept in memory only for the attempt.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import shlex
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from multilane.engine.errors import UserError
from multilane.engine.remote.hosts import HostSpec, host_name_problem, ssh_config_path
from multilane.engine.remote.ssh import paramiko

CONNECT_TIMEOUT_S = 10.0
INSTALL_HINT = "install it there (pip install multilane=={version}) or name it with --remote-command PATH"


class RemoteError(UserError):
    """Something on the connection or the host, in one line."""


class UnknownHostKey(RemoteError):
    """The host's key is not in known_hosts: ``fingerprint`` is what the user must check to trust it."""

    def __init__(self, message: str, fingerprint: str) -> None:
        super().__init__(message)
        self.fingerprint = fingerprint


class NotGiven(RemoteError):
    """The ``ask`` handed in gave no password or passphrase (the user cancelled the box, or closed the
    window): not connected, and the line is all there is to say."""


class Disconnected(RemoteError):
    """The connection dropped (or never came up): a follower retries; a one-shot command reports it."""


def fingerprint(key: Any) -> str:
    """OpenSSH's ``SHA256:...`` fingerprint of a host key."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def known_hosts_name(host: str, port: int) -> str:
    return host if port == 22 else f"[{host}]:{port}"


class Connection:
    """An open SSH connection: run commands, read and write files (SFTP). Thread-safe."""

    def __init__(
        self,
        spec: HostSpec | str,
        remote_command: str = "multilane",
        trust: str | None = None,
        ask: Callable[[str], str | None] | None = None,
        timeout_s: float = CONNECT_TIMEOUT_S,
    ) -> None:
        self.spec = spec if isinstance(spec, HostSpec) else HostSpec.parse(spec)
        self.name = str(self.spec)
        self.remote_command = remote_command
        self.trust, self.ask, self.timeout_s = trust, ask, timeout_s
        self._client: Any = None
        self._sftp: Any = None
        self._lock = threading.RLock()
        self._resolve()

    # -- where and how to connect --------------------------------------------------------------------
    def _resolve(self) -> None:
        """The host's settings: what the user wrote, then ~/.ssh/config, then OpenSSH's defaults."""
        pm = paramiko()
        cfg: dict[str, Any] = {}
        path = ssh_config_path()
        if path.is_file():
            try:
                cfg = dict(pm.SSHConfig.from_path(str(path)).lookup(self.spec.host))
            except Exception as e:  # a config paramiko cannot parse
                raise RemoteError(f"{path}: cannot read it ({e})") from None
        self.hostname = cfg.get("hostname", self.spec.host)
        if self.hostname != self.spec.host and (reason := host_name_problem(self.hostname)):
            raise RemoteError(
                f"{path}: HostName {self.hostname!r} of host {self.spec.host!r} is not a host name ({reason})"
            )
        try:
            self.port = self.spec.port or int(cfg.get("port", 22))
        except ValueError:
            raise RemoteError(f"{path}: Port {cfg.get('port')!r} of host {self.spec.host!r} is not a number") from None
        import getpass

        self.user = self.spec.user or cfg.get("user") or getpass.getuser()
        self.key_files = [str(Path(p).expanduser()) for p in cfg.get("identityfile", [])]
        self.key_files = [p for p in self.key_files if Path(p).is_file()]
        self.only_named_keys = str(cfg.get("identitiesonly", "no")).lower() == "yes"
        files = cfg.get("userknownhostsfile", "~/.ssh/known_hosts").split()
        self.known_hosts = Path(files[0]).expanduser()
        self.proxy_command = cfg.get("proxycommand")
        if "connecttimeout" in cfg:
            with contextlib.suppress(ValueError):
                self.timeout_s = float(cfg["connecttimeout"])

    # -- connecting ----------------------------------------------------------------------------------
    def connect(self) -> Connection:
        with self._lock:
            transport = self._client.get_transport() if self._client is not None else None
            if transport is not None and transport.is_active():
                return self
            self.close()
            self._client = self._open(password=None)
        return self

    def _open(self, password: str | None) -> Any:
        pm = paramiko()
        client = pm.SSHClient()
        system = Path("/etc/ssh/ssh_known_hosts")
        try:
            if system.is_file():
                client.load_system_host_keys(str(system))
            if self.known_hosts.is_file():
                client.load_host_keys(str(self.known_hosts))
        except (OSError, pm.SSHException) as e:
            raise RemoteError(f"{self.known_hosts}: cannot read it ({e})") from None
        client.set_missing_host_key_policy(_AskPolicy(self))
        sock = pm.ProxyCommand(self.proxy_command) if self.proxy_command else None
        where = f"{self.name} ({self.user}@{known_hosts_name(self.hostname, self.port)})"
        started = time.monotonic()
        try:
            client.connect(
                self.hostname,
                port=self.port,
                username=self.user,
                key_filename=self.key_files or None,
                look_for_keys=not self.only_named_keys,
                allow_agent=True,
                password=password,
                passphrase=password,
                timeout=self.timeout_s,
                banner_timeout=self.timeout_s,
                auth_timeout=self.timeout_s,
                channel_timeout=self.timeout_s,
                sock=sock,
            )
        except _UnknownKey as e:
            client.close()
            raise UnknownHostKey(e.args[0], e.args[1]) from None
        except pm.BadHostKeyException as e:
            client.close()
            raise RemoteError(
                f"{where}: the host key has CHANGED ({e.key.get_name()} {fingerprint(e.key)}); refused. If the host "
                f"was reinstalled, remove the old key with: ssh-keygen -f {shlex.quote(str(self.known_hosts))} "
                f"-R {shlex.quote(known_hosts_name(self.hostname, self.port))}"
            ) from None
        except (pm.AuthenticationException, pm.PasswordRequiredException) as e:
            client.close()
            if password is None and self.ask is not None:
                answer = self.ask(f"password or key passphrase for {self.user}@{self.hostname}")
                if answer:
                    return self._open(answer)
            if password is not None:  # a wrong passphrase, or a password the host refused
                raise RemoteError(f"{where}: the password or passphrase was not accepted") from None
            raise RemoteError(
                f"{where}: authentication failed ({_first_line(e)}); add your public key to the host's "
                "~/.ssh/authorized_keys or name the key with IdentityFile in ~/.ssh/config"
            ) from None
        except TimeoutError as e:
            client.close()
            raise Disconnected(
                f"{where}: no answer within {self.timeout_s:g} s ({_first_line(e) or 'timed out'})"
            ) from None
        except pm.SSHException as e:
            client.close()
            text = _first_line(e)
            late = time.monotonic() - started >= self.timeout_s * 0.9
            if late or "banner" in text.lower() or "timed out" in text.lower():
                raise Disconnected(f"{where}: no answer within {self.timeout_s:g} s") from None
            if password is not None:  # paramiko's "Invalid key": the passphrase did not open the key
                raise RemoteError(f"{where}: the password or passphrase was not accepted") from None
            raise Disconnected(f"{where}: SSH failed ({text})") from None
        except OSError as e:
            client.close()
            raise Disconnected(f"{where}: cannot connect ({e.strerror or e})") from None
        transport = client.get_transport()
        if transport is not None:
            transport.set_keepalive(5)  # a dead link is noticed within seconds, not at the next TCP timeout
        return client

    def close(self) -> None:
        with self._lock:
            for thing in (self._sftp, self._client):
                if thing is not None:
                    with contextlib.suppress(Exception):
                        thing.close()
            self._sftp = self._client = None

    def __enter__(self) -> Connection:
        return self.connect()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- commands ------------------------------------------------------------------------------------
    def run(
        self,
        command: str,
        timeout_s: float | None = None,
        login: bool = True,
        stdin: str | None = None,
        max_bytes: int | None = None,
        what: str | None = None,
    ) -> tuple[int, str, str]:
        """Run ``command`` (one shell line, every user value already quoted) on the host: (exit code,
        stdout, stderr). ``login``: through ``sh -l``, so the login PATH applies (pip --user installs).
        ``stdin``: written to the command's standard input, then closed (a secret that must appear on no
        command line). Past ``timeout_s`` (overall, not per read) or ``max_bytes`` of output the command's
        process group is killed there and the line says which (``command.py``); ``what`` names the
        command in that line."""
        from multilane.engine.remote.command import (
            Overrun,
            default_max_bytes,
            default_timeout_s,
            read_bounded,
            wrapped,
        )

        timeout_s = default_timeout_s() if timeout_s is None else timeout_s
        max_bytes = default_max_bytes() if max_bytes is None else max_bytes
        pm = paramiko()
        with self._lock:
            client = self.connect()._client
        chan = None
        try:
            transport = client.get_transport()
            if transport is None or not transport.is_active():
                raise EOFError("not connected")
            chan = transport.open_session(timeout=self.timeout_s)
            chan.exec_command(wrapped(command, login))
            if stdin is not None:
                chan.sendall(stdin.encode())
            chan.shutdown_write()
            answer = read_bounded(chan, timeout_s, max_bytes)
        except Overrun as e:
            self._kill_group(e.pgid)
            if chan is not None:
                chan.close()
            from multilane.engine.display.terminal_text import printable

            name = what or printable(_short(command))
            stopped = "stopped there" if e.pgid is not None else "it named no process group, so it may still run there"
            raise RemoteError(f"{self.name}: {name} {e.reason}; {stopped}") from None
        except (OSError, EOFError, pm.SSHException) as e:
            self.close()
            raise Disconnected(f"{self.name}: the connection dropped ({_first_line(e) or type(e).__name__})") from None
        finally:
            if chan is not None:
                chan.close()
        return answer.code, answer.stdout.decode("utf-8", "replace"), answer.stderr.decode("utf-8", "replace")

    def _kill_group(self, pgid: int | None) -> None:
        """End a command's whole process group there (best effort: the link may be what failed)."""
        from multilane.engine.remote.command import kill_group_line

        if pgid is None:
            return
        with contextlib.suppress(Exception):
            transport = self._client.get_transport() if self._client is not None else None
            if transport is None or not transport.is_active():
                return
            chan = transport.open_session(timeout=self.timeout_s)
            try:
                chan.settimeout(self.timeout_s)
                chan.exec_command(kill_group_line(pgid))
                chan.recv_exit_status()
            finally:
                chan.close()

    def multilane(self, args: str, timeout_s: float | None = None) -> tuple[int, str, str]:
        """Run ``multilane ARGS`` there (``args`` already quoted)."""
        from multilane.engine.display.terminal_text import printable

        what = printable(repr(f"{self.remote_command} {args}"))
        return self.run(f"{shlex.quote(self.remote_command)} {args}", timeout_s, what=what)

    def check_multilane(self) -> str:
        """The remote ``multilane``'s version; one line when it is missing or another version."""
        from multilane.engine import __version__

        code, out, err = self.multilane("--version")
        words = out.split()
        hint = INSTALL_HINT.format(version=__version__)
        if code != 0 or len(words) != 2 or words[0] != "multilane":
            what = (
                "not found"
                if code == 127 or "not found" in err
                else f"did not answer --version ({_first_line(err) or code})"
            )
            raise RemoteError(f"{self.name}: {self.remote_command!r} {what} there; {hint}")
        if words[1] != __version__:
            raise RemoteError(
                f"{self.name}: {self.remote_command!r} is multilane {words[1]}, this computer runs {__version__}; {hint}"
            )
        return words[1]

    # -- files ---------------------------------------------------------------------------------------
    def sftp(self) -> Any:
        with self._lock:
            client = self.connect()._client
            if self._sftp is None:
                pm = paramiko()
                try:
                    self._sftp = client.open_sftp()
                except (OSError, EOFError, pm.SSHException) as e:
                    self.close()
                    raise Disconnected(f"{self.name}: SFTP failed ({_first_line(e)})") from None
                self._sftp.get_channel().settimeout(self.timeout_s)
            return self._sftp

    @property
    def lock(self) -> threading.RLock:
        return self._lock


class _UnknownKey(Exception):
    pass


class _AskPolicy:
    """An unknown host key: trusted only when its fingerprint is the one the user checked."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def missing_host_key(self, client: Any, hostname: str, key: Any) -> None:
        fp = fingerprint(key)
        if self.conn.trust is None or self.conn.trust != fp:
            raise _UnknownKey(
                f"{self.conn.name}: unknown host key {key.get_name()} {fp}; it is not in "
                f"{self.conn.known_hosts}. Check the fingerprint with the host's owner, then trust it with: "
                f"--trust-host-key {fp}",
                fp,
            )
        name = known_hosts_name(self.conn.hostname, self.conn.port)
        path = self.conn.known_hosts
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:  # appended: the user's own lines stay as they are
            f.write(f"{name} {key.get_name()} {key.get_base64()}\n")
        client.get_host_keys().add(name, key.get_name(), key)


def _short(command: str, limit: int = 80) -> str:
    return repr(command if len(command) <= limit else command[: limit - 1] + "…")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


def connect(host: str, **kwargs: Any) -> Connection:
    """An open connection to ``host`` (an ssh config alias or ``[user@]host[:port]``)."""
    return Connection(host, **kwargs).connect()
