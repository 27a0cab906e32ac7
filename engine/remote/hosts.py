"""Which hosts a user can name: ``[user@]host[:port]`` or a ``Host`` alias of ``~/.ssh/config``.

No SSH library here: the app lists the aliases before anything connects. ``~`` is ``$HOME``, as the
Python SSH libraries read it (OpenSSH's own client reads the passwd entry's home instead).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from multilane.engine.errors import UserError

_HOST = re.compile(
    r"^(?:(?P<user>[^@\s:/]+)@)?(?:\[(?P<v6>[0-9A-Fa-f:.%]+)\]|(?P<host>[^@\s:/\[\]]+))(?::(?P<port>\d{1,5}))?$"
)


def host_name_problem(name: str) -> str | None:
    """Why the resolver cannot be asked for ``name`` (a label empty or over 63 characters, text the IDNA
    codec rejects), or None: a name typed on the command line or found in ~/.ssh/config is one line
    naming it, never the codec's traceback from inside ``getaddrinfo``."""
    try:
        name.encode("idna")
    except UnicodeError as e:
        return str(e.__cause__ or e).removeprefix("encoding with 'idna' codec failed ").strip("()")
    return None


@dataclass(frozen=True)
class HostSpec:
    """A host as the user named it; ``ssh/config`` fills in what it leaves out."""

    host: str
    user: str | None = None
    port: int | None = None

    @classmethod
    def parse(cls, text: str) -> HostSpec:
        m = _HOST.match(text.strip())
        if not m or not text.strip():
            raise UserError(f"host {text!r}: expected an ssh config alias or [user@]host[:port]")
        port = int(m["port"]) if m["port"] else None
        if port is not None and not 0 < port < 65536:
            raise UserError(f"host {text!r}: port {port} is outside 1 to 65535")
        if m["host"] and (reason := host_name_problem(m["host"])):
            raise UserError(f"host {text!r}: not a host name ({reason})")
        return cls(m["v6"] or m["host"], m["user"], port)

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return (f"{self.user}@" if self.user else "") + host + (f":{self.port}" if self.port else "")

    @property
    def label(self) -> str:
        """A name safe in a folder name: the mirror of a run on this host goes by it."""
        return re.sub(r"[^A-Za-z0-9._@-]+", "_", str(self))


def ssh_config_path() -> Path:
    return Path.home() / ".ssh" / "config"


def config_hosts(path: Path | None = None) -> list[str]:
    """Every ``Host`` alias of the ssh config that names one host (no ``*``, ``?`` or ``!`` patterns)."""
    path = path or ssh_config_path()
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    out: list[str] = []
    for line in text.splitlines():
        words = line.strip().replace("=", " ", 1).split()
        if len(words) < 2 or words[0].lower() != "host":
            continue
        for alias in words[1:]:
            if alias.startswith("#"):
                break
            if not any(c in alias for c in "*?!") and alias not in out:
                out.append(alias)
    return out


def split_remote_path(text: str) -> tuple[str, str] | None:
    """``HOST:RUN_DIR`` as (host, path), or None when ``text`` names a local path."""
    if text.startswith("["):  # [v6]:port:path
        end = text.find("]")
        rest = text[end + 1 :] if end > 0 else ""
        if rest.startswith(":"):
            port, sep, path = rest[1:].partition(":")
            if sep and port.isdigit():
                return text[: end + 1] + ":" + port, path
        return None
    host, sep, path = text.partition(":")
    if not sep or not host or "/" in host or not path:
        return None
    port, sep2, rest = path.partition(":")
    if sep2 and port.isdigit():  # user@host:2222:/runs/x
        return f"{host}:{port}", rest
    return host, path
