"""Health's part of a run: the loop's one call per step, per log window and per non-finite loss.

``RunHealth`` holds the monitor (monitor.py) and the state kept for a replay (nan_origin.py), and is
handed what it reports to (the run's events, its callbacks, its run folder) and, where the run replays
a NaN, the loop's side of a replay (``StepReplay``, built by the strategy); it never sees the loop
itself. The loop calls ``before_step`` before every step (it keeps the state at a log window's first
step, and at a resume's first step when the checkpoint's window was open), ``report`` at log time and
``explain`` when the loss went non-finite; the step itself calls the monitor directly.

An origin, once found, is the run's best word on its NaN: ``explain`` never replaces it with a weaker
line. When this attempt cannot trace the NaN (no state kept, the replay failed or stayed finite) and the
run folder already holds an origin of a step in the same window (an earlier attempt's, before a
resume), that origin's line is the message again.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from multilane.engine.health.monitor import HealthMonitor
from multilane.engine.health.nan_origin import Kept, StepReplay, find_origin, snapshot

NAN_ORIGIN = "nan_origin.json"
"""The run folder's detail of where a non-finite loss began (the replay's findings)."""


def make_monitor(cfg: Any, task: Any, weighted: bool, lanes: int, device: Any, **spread: Any) -> HealthMonitor:
    """The run's monitor (``cfg``: its ``health`` section) over ``lanes`` devices, its noise scale counted in
    the task's unit: samples, or with a ``loss_weight`` (``weighted``) the task's ``loss_unit``."""
    unit = getattr(task, "loss_unit", None) or "loss weight" if weighted else "samples"
    return HealthMonitor(cfg, lanes, device, unit, **spread)  # spread: ``exchange``, ``sharded``


class RunHealth:
    def __init__(
        self,
        monitor: HealthMonitor,
        replay: StepReplay | None,
        event: Callable[..., None],
        callbacks: Sequence[Any],
    ) -> None:
        """``replay``: the loop's side of a NaN replay (each log window's start is kept for it), or None;
        ``event(name, **fields)``: one of the run's events; ``callbacks``: the run's (``on_health``)."""
        self.monitor, self.replay, self.event, self.callbacks = monitor, replay, event, callbacks
        self.kept: Kept | None = None  # the state before the window's first step, in the same buffers each window
        self.first_step: int | None = None  # the first step of the window the kept state belongs to

    def before_step(self, step: int, window: Any) -> None:
        """Before step ``step + 1``: at a log window's first step keep the state a replay starts from; after
        a resume into an open ``window``, keep the state at the resume (the window's earlier steps were finite)."""
        if window.steps == 0:
            self.window_start(step)
        elif self.first_step is None:  # resumed into an open window
            self.first_step = window.first_step or step + 1
            self._keep()

    def window_start(self, step: int) -> None:
        """Keep the state a replay starts from (the window's first step is ``step + 1``)."""
        if self.replay is not None:
            self._keep()
            self.first_step = step + 1

    def _keep(self) -> None:
        if self.replay is not None:
            self.kept = snapshot(self.replay, self.kept)

    def report(self, rec: dict[str, Any]) -> None:
        """The log window's sampled health: its records first, the noise scale into ``rec``."""
        note, self.monitor.off_note = self.monitor.off_note, None
        if note is not None:  # once, at the first log (the run folder exists by then)
            self.event("noise_scale", message=note)
        noise, records = self.monitor.at_log(rec.get("wall_time"))
        if noise is not None:
            rec["noise"] = noise
        for h in records:
            for cb in self.callbacks:
                cb.on_health(h)

    def explain(self, message: str, step: int, run_dir: Any) -> str:
        """The one line for a non-finite loss noticed at step ``step``: where it began, when a replay finds
        it; the detail goes into ``run_dir`` (the run folder) and an event."""
        kept = self.kept
        if kept is None or self.replay is None:
            return self._recorded(message, step, run_dir)
        try:
            origin = find_origin(self.replay, kept, step)
        except Exception as e:  # the replay is a diagnosis: its failure must not hide the run's
            self.event("warning", message=f"could not replay the steps to find where the NaN began: {e}")
            return self._recorded(message, step, run_dir)
        if origin is None:
            why = f"{message} (a replay of steps {kept.step + 1} to {step} stayed finite: not reproducible)"
            return self._recorded(why, step, run_dir)
        line = origin.line()
        found = {"where": origin.where, "device": origin.device, "layer": origin.layer}
        if run_dir is not None and run_dir.writes:
            run_dir.write_json(NAN_ORIGIN, {"message": line, "kind": origin.kind, **found, **origin.detail})
        self._announce(line, origin.step, origin.kind, found, origin.samples)
        return line

    def _recorded(self, message: str, step: int, rd: Any) -> str:
        """``message``, or the line of an origin the run folder already holds for a step of this window
        (an earlier attempt traced it; a weaker line must not replace it), announced again."""
        first = self.first_step if self.first_step is not None else step
        try:
            rec = json.loads((rd.path / NAN_ORIGIN).read_text()) if rd is not None else None
        except (OSError, ValueError):
            return message
        at = rec.get("step") if isinstance(rec, dict) else None
        line = rec.get("message") if isinstance(rec, dict) else None
        if not isinstance(at, int) or not isinstance(line, str) or not first <= at <= step:
            return message
        found = {k: rec.get(k) for k in ("where", "device", "layer")}
        self._announce(line, at, str(rec.get("kind")), found, list(rec.get("samples") or []))
        return line

    def _announce(self, line: str, step: int, kind: str, found: dict[str, Any], samples: list[int]) -> None:
        self.event("nonfinite_origin", message=line, origin_step=step, origin=kind, samples=samples[:1000], **found)
