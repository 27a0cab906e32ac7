"""A key with a passphrase on the real sshd of ``sshd_server``: ``lock_key`` makes one (``ssh-keygen -N``),
authorizes it there and names it in ``~/.ssh/config`` as the alias ``lockedhost``. No agent holds it
(the ``ssh_home`` fixture drops ``SSH_AUTH_SOCK``), so every connection to that alias needs the
passphrase: the case where an SSH client must ask."""

from __future__ import annotations

import getpass
import subprocess

from sshd_server import SshServer

LOCKED = "lockedhost"
PASSPHRASE = "c0rrect horse; $(battery) 'staple'"  # spaces and shell characters: it is data


def lock_key(server: SshServer, passphrase: str = PASSPHRASE) -> str:
    """Add (once per server) the key with ``passphrase``; returns the alias that uses only that key."""
    key = server.home / ".ssh" / "id_locked"
    if not key.exists():
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", passphrase, "-f", str(key)], check=True)
        pub = key.with_name("id_locked.pub").read_text().strip()
        with open(server.dir / "authorized_keys", "a") as f:  # sshd reads it at each login
            f.write(pub + "\n")
        with open(server.home / ".ssh" / "config", "a") as f:
            f.write(
                f"\nHost {LOCKED}\n  HostName 127.0.0.1\n  Port {server.port}\n  User {getpass.getuser()}\n"
                "  IdentityFile ~/.ssh/id_locked\n  IdentitiesOnly yes\n"
            )
    return LOCKED
