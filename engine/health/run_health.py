"""Health's part of a run: the trainer's one call per log window and per non-finite loss.

``RunHealth`` holds the sampler (monitor.py) and the state kept for a replay (nan_origin.py). The
trainer calls ``before_step`` before every step (it keeps the state at a log window's first step, and
at a resume's first step when the checkpoint's window was open), ``report`` at log time and
``explain`` when the loss went non-finite; the step itself calls the monitor (``t.health``) directly.

An origin, once found, is the run's best word on its NaN: ``explain`` never replaces it with a weaker
line. When this attempt cannot trace the NaN (no state kept, the replay failed or stayed finite) and the
run folder already holds an origin of a step in the same window (an earlier attempt's, before a
resume), that origin's line is the message again.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from multilane.engine.health.monitor import HealthMonitor
from multilane.engine.health.nan_origin import StepKeeper, find_origin

if TYPE_CHECKING:
    from multilane.engine.run.trainer import Trainer

NAN_ORIGIN = "nan_origin.json"
"""The run folder's detail of where a non-finite loss began (the replay's findings)."""


def make_monitor(cfg: Any, task: Any, weighted: bool, lanes: int, device: Any, **spread: Any) -> HealthMonitor:
    """The run's monitor (``cfg``: its ``health`` section) over ``lanes`` devices, its noise scale counted in
    the task's unit: samples, or with a ``loss_weight`` (``weighted``) the task's ``loss_unit``."""
    unit = getattr(task, "loss_unit", None) or "loss weight" if weighted else "samples"
    return HealthMonitor(cfg, lanes, device, unit, **spread)  # spread: ``exchange``, ``sharded``


def strategy_replicas(strategy: Any, lanes: int) -> list[Any] | None:
    """A strategy's own copies of the model (persistent; None until it has made them), or []."""
    if not hasattr(strategy, "replicas") or lanes < 2:
        return []
    return strategy.replicas() or None


class RunHealth:
    def __init__(self, replay: bool, ranks: bool = False) -> None:
        """``replay``: keep each log window's start for a NaN replay; ``ranks``: a ddp rank's (rank_replay.py)."""
        if ranks:
            from multilane.engine.health.rank_replay import RankKeeper, find_rank_origin

            self.keeper: StepKeeper | None = RankKeeper() if replay else None
            self._find: Any = find_rank_origin
        else:
            self.keeper = StepKeeper() if replay else None
            self._find = find_origin
        self.first_step: int | None = None  # the first step of the window the kept state belongs to

    def before_step(self, t: Trainer) -> None:
        """Before every step: at a log window's first step keep the state a replay starts from; after a
        resume into an open window, keep the state at the resume (the window's earlier steps were finite)."""
        if t.window.steps == 0:
            self.window_start(t)
        elif self.first_step is None:  # resumed into an open window
            self.first_step = t.window.first_step or t.step + 1
            if self.keeper is not None:
                self.keeper.keep(t)

    def window_start(self, t: Trainer) -> None:
        """Keep the state a replay starts from (the window's first step is the next)."""
        if self.keeper is not None:
            self.keeper.keep(t)
            self.first_step = t.step + 1

    def report(self, t: Trainer, rec: dict[str, Any]) -> None:
        """The log window's sampled health: its records first, the noise scale into ``rec``."""
        note, t.health.off_note = t.health.off_note, None
        if note is not None:  # once, at the first log (the run folder exists by then)
            t._event("noise_scale", message=note)
        noise, records = t.health.at_log(rec.get("wall_time"))
        if noise is not None:
            rec["noise"] = noise
        for h in records:
            for cb in t.callbacks:
                cb.on_health(h)

    def explain(self, t: Trainer, message: str) -> str:
        """The one line for a non-finite loss: where it began, when a replay finds it; the detail
        goes into the run folder and an event."""
        kept = self.keeper.kept if self.keeper is not None else None
        if kept is None:
            return self._recorded(t, message)
        try:
            origin = self._find(t, kept, t.step)
        except Exception as e:  # the replay is a diagnosis: its failure must not hide the run's
            t._event("warning", message=f"could not replay the steps to find where the NaN began: {e}")
            return self._recorded(t, message)
        if origin is None:
            why = f"{message} (a replay of steps {kept.step + 1} to {t.step} stayed finite: not reproducible)"
            return self._recorded(t, why)
        line = origin.line()
        found = {"where": origin.where, "device": origin.device, "layer": origin.layer}
        if t.run_dir is not None and t.run_dir.writes:
            t.run_dir.write_json(NAN_ORIGIN, {"message": line, "kind": origin.kind, **found, **origin.detail})
        self._announce(t, line, origin.step, origin.kind, found, origin.samples)
        return line

    def _recorded(self, t: Trainer, message: str) -> str:
        """``message``, or the line of an origin the run folder already holds for a step of this window
        (an earlier attempt traced it; a weaker line must not replace it), announced again."""
        first = self.first_step if self.first_step is not None else t.step
        rd = t.run_dir
        try:
            rec = json.loads((rd.path / NAN_ORIGIN).read_text()) if rd is not None else None
        except (OSError, ValueError):
            return message
        step = rec.get("step") if isinstance(rec, dict) else None
        line = rec.get("message") if isinstance(rec, dict) else None
        if not isinstance(step, int) or not isinstance(line, str) or not first <= step <= t.step:
            return message
        found = {k: rec.get(k) for k in ("where", "device", "layer")}
        self._announce(t, line, step, str(rec.get("kind")), found, list(rec.get("samples") or []))
        return line

    @staticmethod
    def _announce(t: Trainer, line: str, step: int, kind: str, found: dict[str, Any], samples: list[int]) -> None:
        t._event("nonfinite_origin", message=line, origin_step=step, origin=kind, samples=samples[:1000], **found)
