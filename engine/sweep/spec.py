"""What a sweep is: the task and base config every trial shares, the search space, the objective, the
sampler and pruner, the trial count and devices per trial. Saved in the study itself (so a
``sweep-worker`` elsewhere reads it from the storage) and in the sweep folder's ``sweep.json``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from multilane.engine.errors import UserError
from multilane.engine.sweep.space import ParamSpec

SPEC_ATTR = "multilane_sweep"  # the study's user attribute that holds the spec


@dataclass
class SweepSpec:
    task: str
    params: list[ParamSpec]
    trials: int
    base: dict[str, Any] = field(default_factory=dict)  # dotted overrides every trial shares (steps, batch size, ...)
    per_trial: int = 1
    objective: str = "val_loss"
    direction: str = "minimize"
    sampler: str = "tpe"
    pruner: str = "median"
    seed: int | None = None
    name: str = "sweep"
    trial_timeout: float | None = None  # seconds a trial may run before it is stopped and recorded failed

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["params"] = [p.to_dict() for p in self.params]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SweepSpec:
        try:
            data = dict(d)
            data["params"] = [ParamSpec.from_dict(p) for p in d["params"]]
            return cls(**data)
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(f"the sweep's saved spec is damaged ({e})") from None


def parse_objective(text: str) -> tuple[str, str]:
    """``val_loss:min`` -> ("val_loss", "minimize"); a metric alone is minimized unless it is accuracy-like."""
    name, sep, way = text.partition(":")
    name = name.strip()
    if not name or not name.replace("_", "").replace(".", "").isalnum():
        raise UserError(f"--objective {text!r}: expected METRIC:min or METRIC:max, e.g. val_loss:min")
    way = way.strip().lower()
    if not sep:
        way = "max" if any(w in name for w in ("acc", "f1", "auc", "score")) else "min"
    if way not in ("min", "max"):
        raise UserError(f"--objective {text!r}: {way!r} is neither min nor max")
    return name, "minimize" if way == "min" else "maximize"
