"""Training on SSH hosts from the window: the host bar and its devices, picks across hosts (one ddp run), passwords and passphrases asked in the window, and resuming a run on a host."""

from multilane.engine.exports import lazy_exports

__getattr__, __all__ = lazy_exports(
    __name__,
    {
        "HostBar": "host_bar",
        "HostPicks": "host_picks",
        "HostSecrets": "secrets",
    },
)
