"""How a ddp run's failure is recorded, on one machine or several.

A failing rank takes its peers down with it: they fail too, but only with "connection closed" (they
lost a peer). What the user needs is the first failure, whichever machine it happened on. So every
failure is written down as a note in the run folder, ``failures/rank<N>.json`` (on a shared
filesystem, that is every node's): a rank that raises writes its own (message and traceback); a
launcher writes one for each of its ranks that failed, also one killed by a signal, which could not.
Then ``consolidate`` (under a lock in the run folder) picks the note that caused the others (a rank's
own error or a signal before "lost its peers", then the earliest, then the lowest rank) and writes it
as the run's outcome: ``status.json`` failed, a ``failed`` event naming the rank, its traceback in
``error.txt``. Every launcher that knows the folder consolidates after writing its notes, and so does
rank 0, so whichever comes last has seen every note and the outcome names the real failure.

A refusal is not a failure: a rank that finds bad input (a damaged checkpoint, a setting its device
cannot take: ``UserError``) before the run began writes nothing into the run folder and prints
nothing; it leaves its one line in its node's folder (``REFUSALS``, beside ``NODE_FILE_ENV``'s file)
and exits 2. The launcher says that line once and exits 2, as the one-process path does, and leaves
the run folder as it found it (``FolderAsFound``): a refused resume changes no byte of it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import filelock
from multilane.engine.distributed import NODE_FILE_ENV
from multilane.engine.rundir.run_lock import LOCK, lock_is_held
from multilane.engine.rundir.runlog import ERROR, STATUS, RunDir, iter_metrics

NOTES = "failures"
LOST_PEERS = "RankLostPeers"
LOST_PEER_ERROR = re.compile(
    r"Connection closed by peer|Connection reset|Broken pipe|DistNetworkError|timed out|Timeout", re.I
)
"""An error that means "another rank went away", not "this rank went wrong"."""
REFUSALS = "refusals"  # in the node's folder: rank<N>.json, the line of a rank that refused to run


def note_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / NOTES / f"rank{rank}.json"


def clear_notes(run_dir: Path) -> None:
    """Forget an earlier launch's notes (rank 0, as a launch opens the folder)."""
    folder = Path(run_dir) / NOTES
    if folder.is_dir():
        for f in folder.glob("rank*.json"):
            f.unlink(missing_ok=True)


def write_note(run_dir: Path, rank: int, message: str, traceback: str | None, lost: bool, at: float) -> None:
    path = note_path(run_dir, rank)
    path.parent.mkdir(exist_ok=True)
    tmp = path.with_suffix(".tmp")
    note = {"rank": rank, "message": message, "traceback": traceback, "lost_peers": lost, "time": at}
    tmp.write_text(json.dumps(note))
    tmp.replace(path)


def read_notes(run_dir: Path, folder: str = NOTES) -> list[dict[str, Any]]:
    notes = []
    for f in sorted((Path(run_dir) / folder).glob("rank*.json")):
        try:
            notes.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            continue
    return notes


def primary(notes: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The failure that caused the others."""
    return min(notes, key=lambda n: (bool(n["lost_peers"]), n["time"], n["rank"]), default=None)


def notes_from_child_failure(run_dir: Path, e: Any) -> None:
    """A launcher's notes for its ranks that failed (torch's ``ChildFailedError``)."""
    for rank, f in e.failures.items():
        lost = False
        if f.exitcode < 0:
            message, tb = f"rank {rank} (pid {f.pid}) was killed by {f.signal_name()}", None
        elif isinstance(f.message, dict):
            text = str(f.message.get("message", ""))
            # RankLostPeers, or a set-up that failed on a peer's lost connection (a UserError's "setup failed")
            lost = LOST_PEERS in text or bool(LOST_PEER_ERROR.search(text))
            text = text.split(": ", 1)[1] if text.startswith(("RankFailed: ", f"{LOST_PEERS}: ")) else text
            message = text or f"rank {rank} exited with {f.exitcode}"
            tb = f.message.get("extraInfo", {}).get("py_callstack")
        else:
            message, tb = f"rank {rank} (pid {f.pid}) exited with status {f.exitcode}", None
        old = note_path(run_dir, rank)
        if old.exists() and not f.exitcode < 0:
            continue  # the rank wrote its own note (the same error, its exact time)
        write_note(run_dir, rank, message, tb, lost, float(f.timestamp or time.time()))


def note_silent_ranks(run_dir: Path, world: int) -> None:
    """One node's run whose notes all say "lost its peers": a rank of the ``world`` that left no note at
    all ended without a word (a signal killed it with its supervisor, engine/start/ranks.py, or killed it
    where nobody saw) and caused the others. Its note says so, so that the outcome names it."""
    notes = read_notes(run_dir)
    if not notes or any(not n["lost_peers"] for n in notes):
        return
    noted, first = {n["rank"] for n in notes}, min(n["time"] for n in notes)
    for rank in range(world):
        if rank not in noted:
            message = f"rank {rank} ended and left no word of why (a signal that kills a rank's supervisor leaves none)"
            write_note(run_dir, rank, message, None, False, first)


NODES = "nodes.json"  # a run across hosts: each node's host (engine/remote/multi_host.py writes it)


def unheard_nodes(run_dir: Path, cause: dict[str, Any]) -> str:
    """When the failure is a lost peer in a run across hosts: "; lost node 1 (HOST, ADDRESS): the link to
    it or the host itself went down". The nodes named are those none of whose ranks left a note here
    (without a shared filesystem, what host 0 cannot hear from); where every node left one (a shared
    filesystem: every rank timed out alike), every node but host 0's, whose run folder this is."""
    if not cause.get("lost_peers"):
        return ""
    try:
        nodes = json.loads((run_dir / NODES).read_text(encoding="utf-8"))["nodes"]
        spans, first = [], 0
        for n in nodes:
            count = len([d for d in str(n["devices"]).split(",") if d.strip()])
            spans.append((n, range(first, first + count)))
            first += count
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    notes = read_notes(run_dir)
    if any(not n["lost_peers"] for n in notes):
        return ""  # a rank's own error is the cause: no node was lost
    noted = {n["rank"] for n in notes}
    silent = [n for n, ranks in spans if not noted.intersection(ranks)]
    lost = silent or [n for n, _ in spans[1:]]
    names = ", ".join(f"node {n['node']} ({n['host']}, {n['address']})" for n in lost)
    return f"; lost {names}: the link to it or the host itself went down" if lost else ""


def consolidate(run_dir: Path, wait_for_cause_s: float = 0.0) -> dict[str, Any] | None:
    """Write the primary failure among the notes as the run's outcome; return it.

    ``wait_for_cause_s``: while only "lost its peers" notes are there, wait up to that long for the
    note of the failure that caused them (another node's launcher writes it a moment later)."""
    end = time.monotonic() + wait_for_cause_s
    notes = read_notes(run_dir)
    while notes and all(n["lost_peers"] for n in notes) and time.monotonic() < end:
        time.sleep(0.1)
        notes = read_notes(run_dir)
    (Path(run_dir) / NOTES).mkdir(exist_ok=True)
    with filelock.FileLock(Path(run_dir) / NOTES / ".lock", timeout=30):
        cause = primary(read_notes(run_dir))
        if cause is None:
            return None
        rd = RunDir(Path(run_dir))
        try:
            old = rd.read_json(STATUS) or {}
            if old.get("state") == "failed" and old.get("message") == cause["message"]:
                return cause  # already recorded
            step = max(
                (r.get("step", 0) for r in iter_metrics(Path(run_dir) / "metrics.jsonl") if r.get("kind") == "train"),
                default=0,
            )
            if cause["traceback"] or not (Path(run_dir) / ERROR).exists():
                rd.write_error(cause["traceback"] or cause["message"] + "\n")
            rank, message = cause["rank"], cause["message"] + unheard_nodes(Path(run_dir), cause)
            rd.set_status("failed", message, step=step, total_steps=old.get("total_steps"), rank=rank)
            event = {"kind": "event", "event": "failed", "step": step, "wall_time": time.time()}
            rd.append_metric({**event, "message": message, "rank": rank})
        finally:
            rd.close()
        return cause


def write_refusal(rank: int, message: str, lost: bool) -> bool:
    """Rank ``rank`` refused to run (``message``, one line; ``lost``: it only lost its peers, whose
    refusal is the cause): the note for this node's launcher, which says it. False where no launcher
    of ours listens (bare torchrun: the rank says it itself)."""
    node_file = os.environ.get(NODE_FILE_ENV)
    if not node_file:
        return False
    path = Path(node_file).parent / REFUSALS / f"rank{rank}.json"
    note = {"rank": rank, "message": message, "traceback": None, "lost_peers": lost, "time": time.time()}
    try:
        path.parent.mkdir(exist_ok=True)
        path.with_suffix(".tmp").write_text(json.dumps(note))
        path.with_suffix(".tmp").replace(path)
    except OSError:
        return False
    return True


def refusal(node_dir: Path) -> str | None:
    """The line of the refusal that ended this node's ranks, if one did: a rank's own (the earliest,
    then the lowest rank), not one that refused only because its peers had gone."""
    notes = [n for n in read_notes(node_dir, REFUSALS) if not n.get("lost_peers")]
    cause = primary(notes)
    return str(cause["message"]) if cause else None


class FolderAsFound:
    """A run folder as a launcher found it, put back as it was after its ranks refused to run.

    A resumed folder: rank 0 leaves it as it found it (``RunDir.close_refused``), but a rank 0 the
    agent had to kill could not put back the lock file it wrote; this does, once the lock is free. A
    folder this launcher made for a new run: removed while it holds nothing but what making it wrote
    (the one-process path makes none before its checks)."""

    def __init__(self, run_dir: Path | None, made_here: bool) -> None:
        self.run_dir, self.made_here = run_dir, made_here
        self.lock = self._file(LOCK) if run_dir is not None and not made_here else None
        # rank 0 says "starting" and its phase in status.json before it reads the checkpoint; a rank 0
        # killed because a peer refused first cannot put it back (under load it often is): this does
        self.status = self._file(STATUS) if run_dir is not None and not made_here else None

    def _file(self, name: str) -> tuple[bytes, int, int] | None:
        assert self.run_dir is not None
        with contextlib.suppress(OSError):
            st = os.stat(self.run_dir / name, follow_symlinks=False)
            if st.st_size <= 1 << 20:
                return (self.run_dir / name).read_bytes(), st.st_atime_ns, st.st_mtime_ns
        return None

    def restore(self) -> None:
        path = self.run_dir
        if path is None or not path.is_dir() or lock_is_held(path):
            return
        with contextlib.suppress(OSError):
            if self.made_here:
                checkpoints = path / "checkpoints"
                if {p.name for p in path.iterdir()} <= {LOCK, "checkpoints"} and not any(checkpoints.iterdir()):
                    shutil.rmtree(path)
                return
            now_status = self._file(STATUS)
            if self.status is not None and (now_status is None or now_status[0] != self.status[0]):
                (path / STATUS).write_bytes(self.status[0])
                os.utime(path / STATUS, ns=self.status[1:], follow_symlinks=False)
            now = self._file(LOCK)
            if self.lock is None and now is not None:
                (path / LOCK).unlink()
            elif self.lock is not None and (now is None or now[0] != self.lock[0] or now[2] != self.lock[2]):
                (path / LOCK).write_bytes(self.lock[0])
                os.utime(path / LOCK, ns=self.lock[1:], follow_symlinks=False)
