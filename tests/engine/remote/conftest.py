"""The remote tests share one real sshd per module (tests/sshd_server.py)."""

from sshd_server import ssh_home, sshd  # noqa: F401 (fixtures)
