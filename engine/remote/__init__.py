"""Remote hosts over SSH: connecting to a server (OpenSSH config, keys, known_hosts), launching a run there, mirroring its run folder here."""

from multilane.engine.exports import lazy_exports

__getattr__, __all__ = lazy_exports(
    __name__,
    {
        "HostSpec": "hosts",
        "config_hosts": "hosts",
        "Connection": "connection",
        "connect": "connection",
        "launch_run": "launch",
        "launch_multi_host": "multi_host",
        "RemoteFollower": "mirror",
        "RemoteMirror": "mirror",
    },
)
