"""A run across several hosts, in the window: one launcher started on each host (``remote/multi_host.py``),
then followed through host 0's run folder, its mirror, exactly as a run on one host
(``RemoteFollowWorker``): Pause, Resume and Stop write host 0's control file, which every node obeys.
The connections are opened and the launchers started in the worker's thread, never the GUI thread."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from multilane.engine.remote.connection import Connection
from multilane.engine.remote.mirror import RemoteFollower, RemoteMirror, mirror_folder
from multilane.engine.remote.multi_host import Node, launch_multi_host
from multilane.gui.runs.remote_follow import RemoteFollowWorker


class MultiHostFollowWorker(RemoteFollowWorker):
    """Starts one ddp run across ``nodes`` (host, devices, remote command, runs folder there) and
    follows the first host's run folder."""

    def __init__(
        self, nodes: list[tuple[str, str, str, str | None]], local_runs: str | Path, config: dict[str, Any]
    ) -> None:
        host, _, command, runs = nodes[0]
        super().__init__(host, local_runs, command, config=config, remote_runs=runs)
        self.nodes = nodes

    def _connect(self) -> None:
        conns: list[Connection] = []
        try:
            for host, _, command, _ in self.nodes:  # every host answers before anything starts
                conns.append(Connection(host, remote_command=command).connect())
            nodes = [Node(c, devices, runs) for c, (_, devices, _, runs) in zip(conns, self.nodes, strict=True)]
            launched = launch_multi_host(nodes, self.config or {})
        except BaseException:
            for c in conns:
                c.close()
            raise
        for c in conns[1:]:  # the run is followed (and controlled) through the first host alone
            with contextlib.suppress(Exception):
                c.close()
        run = launched.run
        mirror = RemoteMirror(conns[0], run.path, mirror_folder(self.local_runs, conns[0].spec.label, run.path), run)
        self.run_dir = mirror.local
        self.follower = RemoteFollower(mirror)

    def _info(self) -> dict[str, Any]:
        """The title names every host's devices (the run's config.json holds the first host's only)."""
        return {**super()._info(), "devices": [f"{host} {devices}" for host, devices, _, _ in self.nodes]}
