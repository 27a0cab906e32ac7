"""How a ddp run's ranks agree on pause, stop, a timed checkpoint and sending their telemetry early: each
rank's requests in a tiny all-reduce (max) per step, so every rank acts on the same flags at the same
step. A part of the ddp and fsdp strategies (ddp.py), which hold the control group and this rank's
requests; the loop ``t`` holds the agreed run control and the control file."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from multilane.engine.run import checkpointer

if TYPE_CHECKING:
    from multilane.engine.run.trainer import Trainer

PAUSE_POLL_S = 0.2
TELEMETRY_LAG_S = 2.0
"""The longest another rank's telemetry waits for a log window before it is sent to rank 0 alone."""


class RankAgreement:
    """The ranks' agreement on pause and stop (a part of the rank strategies, ddp.py)."""

    info: Any
    requests: Any
    rank_telemetry: Any
    control_group: Any
    _parent: int
    _pending: Any
    _due_at: Any

    def _flags(self, *bits: bool) -> torch.Tensor:
        return torch.tensor([int(b) for b in bits], dtype=torch.int32)

    def sync_control(self, t: Trainer) -> None:
        """Every rank contributes its own requests to a tiny all-reduce (max) started at the top of
        step s and read at the top of step s+1, so it overlaps the step's compute; all ranks then
        act on the same agreed flags at the same step. The third flag: a rank's telemetry has waited
        ``TELEMETRY_LAG_S`` for a log window, so all ranks send it to rank 0 now. The fourth: a rank's
        ``train.checkpoint_minutes`` have passed, so all ranks save at the end of step s+1 (saving is a
        collective: every rank's random stream goes into the checkpoint)."""
        t._control_file.apply(self.requests)
        if os.getppid() != self._parent:  # the launcher (or torchrun's agent) is gone: stop, with a checkpoint
            self.requests.request_stop()
        if self._pending is not None:
            work, flags = self._pending
            self._pending = None
            work.wait()
            stop, pause, telemetry, due = flags.tolist()
            if due and self._due_at == t.checkpoint_time:  # no checkpoint since it was asked for
                self._due_agreed = True
            if stop:
                self._stop_agreed(t)
                return
            if pause:
                t.control.pause()
                return
            if telemetry:
                self._gather_telemetry(t)
        overdue = self.rank_telemetry.overdue(TELEMETRY_LAG_S)
        flags = self._flags(self.requests.stop_requested, self.requests.pause_requested, overdue, checkpointer.due(t))
        self._due_at = t.checkpoint_time
        work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.control_group, async_op=True)
        self._pending = (work, flags)

    def _stop_agreed(self, t: Trainer) -> None:
        """Every rank saw a stop: this rank's own requests and its run control both say so."""
        self.requests.request_stop()
        t.control.request_stop(self.requests.stop_reason)  # rank 0's reason from its control file

    def checkpoint_due(self, t: Trainer) -> bool:
        due, self._due_agreed = getattr(self, "_due_agreed", False), False
        return due

    def _gather_telemetry(self, t: Trainer) -> None:
        """Every rank's buffered telemetry to rank 0, between log windows (a long window's)."""
        everyone: list[Any] = [None] * self.info.world
        dist.all_gather_object(everyone, self.rank_telemetry.take(), group=self.control_group)
        if self.info.is_main:
            for records in everyone[1:]:
                for r in records:
                    t.dispatch(r)

    def _drain_pending(self) -> None:
        if self._pending is not None:
            work, _ = self._pending
            self._pending = None
            work.wait()

    def wait_paused(self, t: Trainer) -> None:
        """Paused: every ``PAUSE_POLL_S`` all ranks compare notes (a sync all-reduce); a resume or a
        stop seen by any rank ends the pause on all of them."""
        self._drain_pending()
        self.requests.pause()
        while True:
            time.sleep(PAUSE_POLL_S)
            t._control_file.apply(self.requests)
            flags = self._flags(self.requests.stop_requested, not self.requests.pause_requested)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.control_group)
            stop, run = flags.tolist()
            if stop:
                self._stop_agreed(t)
                return
            if run:
                self.requests.resume()
                t.control.resume()
                return
