"""No trial outlives its sweep: each trial runs in its own session, and beside it runs a guard, a small
stdlib-only process (this file, run as a script) that waits on a pipe whose other end only the sweep
process holds. What the guard ends is the trial's whole tree, however deep: every process of the trial's
session or process group and every descendant of those (DataLoader workers, a ranks' server and its ranks,
resource trackers, anything a task starts, even in a session of its own), also those orphaned on the way
(the guard notes the tree every second while the trial runs, so a process whose parent died first is
still known).

- The sweep ends by any path (finished, kill -9): the kernel closes the pipe; while the trial's leader
  lives, it gets the grace (it has its parent-death SIGTERM: a stop with a checkpoint once its step
  returns; a second SIGTERM would abort it); then the whole tree gets SIGKILL. A leader already gone
  leaves only leftovers: they get ``SHORT_GRACE_S``.
- The sweep exits on a second Ctrl+C: it writes ``HURRY`` first, and the tree gets ``SHORT_GRACE_S``.

The trial itself gets SIGTERM when the sweep dies (a trial forked from the sweep's pre-imported server
watches the sweep's pidfd; one started with ``MULTILANE_TRIAL_START=exec`` has the kernel's
``PR_SET_PDEATHSIG``). Alone, that signal could not end a hung step: its handler only sets a flag the
step never reaches."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time

GRACE_ENV = "MULTILANE_TRIAL_GRACE_S"
DEFAULT_GRACE_S = 30.0
SHORT_GRACE_S = 3.0  # a second Ctrl+C, or leftovers of a trial whose leader has ended
HURRY = b"k"
NOTE_EVERY_S = 1.0


def grace_s() -> float:
    """Seconds a trial gets to stop (SIGTERM: a checkpoint) before SIGKILL; ``MULTILANE_TRIAL_GRACE_S``."""
    try:
        value = float(os.environ.get(GRACE_ENV, DEFAULT_GRACE_S))
    except ValueError:
        return DEFAULT_GRACE_S
    return value if 0 < value < 86400 else DEFAULT_GRACE_S


def _stat(pid: int, zombie: bool = False) -> tuple[int, int, int, int] | None:
    """(ppid, pgid, sid, start time) of ``pid`` from /proc; None when it is gone or (unless ``zombie``)
    a zombie, which holds its pid until it is reaped."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2 :].split()  # after the command's name, which may hold spaces
    if fields[0] == b"X" or (fields[0] == b"Z" and not zombie):
        return None
    return int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19])


def tree(leader: int, leader_start: int | None = None, known: dict[int, int] | None = None) -> dict[int, int]:
    """Every living process of ``leader``'s session or process group, and every descendant of those, of
    ``leader`` and of ``known``: pid -> start time (so that a pid used again later is not taken for one
    of them). Once the leader (started at ``leader_start``) has ended, its pid may be another process's:
    then only ``known`` and their descendants count."""
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None:
                table[int(name)] = st
    lead = _stat(leader, zombie=True)  # the leader's pid is still its own while it is a zombie
    same = lead is not None and (leader_start is None or lead[3] == leader_start)
    found = {pid: st[3] for pid, st in table.items() if same and (pid == leader or leader in (st[1], st[2]))}
    found.update({pid: start for pid, start in (known or {}).items() if pid in table and table[pid][3] == start})
    grew = True
    while grew:
        grew = False
        for pid, st in table.items():
            if pid not in found and st[0] in found:
                found[pid] = st[3]
                grew = True
    found.pop(os.getpid(), None)
    return found


def kill_tree(
    leader: int, sig: int = signal.SIGKILL, known: dict[int, int] | None = None, leader_start: int | None = None
) -> int:
    """``sig`` to ``leader``'s whole tree (``tree``) and to what of ``known`` still runs; how many were
    signalled. Each is stopped first (SIGSTOP), so that none starts another or dies and orphans its
    children between the count and the signal."""
    found = tree(leader, leader_start, known)
    if sig == signal.SIGKILL:
        for pid in found:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGSTOP)
        found = {**found, **tree(leader, leader_start, found)}
    for pid in found:
        with contextlib.suppress(OSError):
            os.kill(pid, sig)
    return len(found)


def signal_group(pgid: int, sig: int) -> None:
    """``sig`` to a trial's process group (gone already: nothing to do)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


class TrialGuard:
    """The guard of one trial's tree; ``release`` when the trial has ended (leftovers are then ended
    too), ``hurry`` when the sweep exits at once (a second Ctrl+C)."""

    def __init__(self, pgid: int) -> None:
        read_end, self._write_end = os.pipe()  # both close on exec: no other child inherits the sweep's end
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-S", os.path.abspath(__file__), str(pgid), str(grace_s())],
                stdin=read_end,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # the terminal's Ctrl+C is the sweep's to handle, not the guard's
            )
        finally:
            os.close(read_end)

    def hurry(self) -> None:
        """The sweep is exiting now: the trial's tree gets ``SHORT_GRACE_S``, not the whole grace."""
        if self._write_end >= 0:
            with contextlib.suppress(OSError):
                os.write(self._write_end, HURRY)
        self.release()

    def release(self) -> None:
        if self._write_end >= 0:
            with contextlib.suppress(OSError):
                os.close(self._write_end)
            self._write_end = -1


def _guard(leader: int, grace: float) -> None:
    """The guard process: note the tree while the pipe on stdin is open, then end it (see the module)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    first = _stat(leader)
    start = first[3] if first is not None else None
    known = tree(leader, start)
    hurried = False
    while True:
        try:
            ready, _, _ = select.select([0], [], [], NOTE_EVERY_S)
        except InterruptedError:
            continue
        if not ready:
            known = tree(leader, start, known)
            continue
        try:
            got = os.read(0, 64)
        except InterruptedError:
            continue
        except OSError:
            got = b""
        hurried = hurried or HURRY in got
        if not got:
            break
    now = _stat(leader)
    leader_alive = now is not None and now[3] == start
    wait = grace if leader_alive and not hurried else min(SHORT_GRACE_S, grace)
    end = time.monotonic() + wait
    while time.monotonic() < end:
        known = tree(leader, start, known)
        if not known:
            return
        time.sleep(0.1)
    for _ in range(3):  # a process forked between the count and the kill is caught by the next round
        if not kill_tree(leader, signal.SIGKILL, known, start):
            return
        known = tree(leader, start, known)
        time.sleep(0.1)


if __name__ == "__main__":
    _guard(int(sys.argv[1]), float(sys.argv[2]))
