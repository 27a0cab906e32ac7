"""Health's part of a run: the trainer's one call per log window and per non-finite loss.

``RunHealth`` holds the sampler (monitor.py) and the state kept for a replay (nan_origin.py). The
trainer calls ``window_start`` before a log window's first step, ``report`` at log time and
``explain`` when the loss went non-finite; the step itself calls the monitor (``t.health``) directly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from multilane.engine.health.monitor import HealthMonitor
from multilane.engine.health.nan_origin import StepKeeper, find_origin

if TYPE_CHECKING:
    from multilane.engine.run.trainer import Trainer

NAN_ORIGIN = "nan_origin.json"
"""The run folder's detail of where a non-finite loss began (the replay's findings)."""


def make_monitor(t: Trainer, lanes: int, device: Any, exchange: Any = None, sharded: bool = False) -> HealthMonitor:
    unit = "samples" if t._loss_weight is None else getattr(t.task, "loss_unit", "") or "loss weight"
    return HealthMonitor(t.config.health, lanes, device, unit, exchange, sharded)


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

    def window_start(self, t: Trainer) -> None:
        """Before a log window's first step: keep the state a replay starts from."""
        if self.keeper is not None:
            self.keeper.keep(t)

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
            return message
        try:
            origin = self._find(t, kept, t.step)
        except Exception as e:  # the replay is a diagnosis: its failure must not hide the run's
            t._event("warning", message=f"could not replay the steps to find where the NaN began: {e}")
            return message
        if origin is None:
            return f"{message} (a replay of steps {kept.step + 1} to {t.step} stayed finite: not reproducible)"
        line = origin.line()
        if t.run_dir is not None and t.run_dir.writes:
            t.run_dir.write_json(NAN_ORIGIN, {"message": line, "kind": origin.kind, **origin.detail})
        t._event(
            "nonfinite_origin",
            message=line,
            origin_step=origin.step,
            origin=origin.kind,
            where=origin.where,
            device=origin.device,
            samples=origin.samples[:1000],
        )
        return line
