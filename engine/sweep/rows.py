"""A sweep's trials as plain rows, for the CLI's live table, the app's table and the CSV export."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from multilane.engine.sweep.optuna_lib import optuna

COLUMNS = ("number", "state", "value", "best", "step", "duration_s", "devices", "host", "run_dir")


def trial_rows(study: Any, steps: dict[int, int] | None = None) -> list[dict[str, Any]]:
    """One dict a trial, by number: its state (lowercase), params, objective value, the best value so far
    (in the order trials finished), its step, its duration, devices and run folder; the best one marked."""
    ts = optuna().trial.TrialState
    trials = study.get_trials(deepcopy=False)
    maximize = study.direction.name == "MAXIMIZE"
    best_so_far: dict[int, float] = {}
    best: float | None = None
    done = sorted((t for t in trials if t.state == ts.COMPLETE), key=lambda t: t.datetime_complete)
    for t in done:
        if t.value is not None and (best is None or (t.value > best if maximize else t.value < best)):
            best = t.value
        best_so_far[t.number] = best  # type: ignore[assignment]
    best_number = next((t.number for t in done if t.value == best), None) if best is not None else None
    now = time.time()
    rows = []
    for t in sorted(trials, key=lambda t: t.number):
        state = t.state.name.lower()
        if state == "fail" and t.user_attrs.get("lost"):
            state = "lost"
        elif state == "fail":
            state = "failed"
        start = t.datetime_start.timestamp() if t.datetime_start else None
        end = t.datetime_complete.timestamp() if t.datetime_complete else None
        run_dir = t.user_attrs.get("run_dir")
        # The freshest of what is known: the live follower's, the recorded last, status.json's, the last report.
        known = [(steps or {}).get(t.number), t.user_attrs.get("last_step"), _status_step(run_dir)]
        known.append(max(t.intermediate_values) if t.intermediate_values else None)
        step = max((k for k in known if isinstance(k, int)), default=None)
        rows.append(
            {
                "number": t.number,
                "state": state,
                # A re-queued (or grid) trial waits with its parameters fixed, not yet suggested: shown too.
                "params": dict(t.params) or dict(t.system_attrs.get("fixed_params") or {}),
                "value": t.value if t.state == ts.COMPLETE else _last(t),
                "best": best_so_far.get(t.number),
                "is_best": t.number == best_number,
                "step": step,
                "duration_s": (end or now) - start if start else None,
                "devices": t.user_attrs.get("devices", ""),
                "host": t.user_attrs.get("worker") or t.user_attrs.get("host", ""),
                "run_dir": run_dir or "",
                "error": t.user_attrs.get("error") or t.user_attrs.get("lost") or "",
            }
        )
    return rows


def _last(t: Any) -> float | None:
    if not t.intermediate_values:
        return None
    return t.intermediate_values[max(t.intermediate_values)]


def _status_step(run_dir: str | None) -> int | None:
    if not run_dir:
        return None
    try:
        s = json.loads((Path(run_dir) / "status.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    step = s.get("step") if isinstance(s, dict) else None
    return step if isinstance(step, int) else None


def rows_csv(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """The table as CSV: one column per parameter between the state and the value."""
    import csv

    keys = sorted({k for r in rows for k in r["params"]})
    p = Path(path)
    with open(p, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(
            ["number", "state", *keys, "value", "best", "is_best", "step", "duration_s", "devices", "host", "run_dir"]
        )
        for r in rows:
            w.writerow(
                [r["number"], r["state"], *(r["params"].get(k, "") for k in keys), _num(r["value"]), _num(r["best"]),
                 int(r["is_best"]), r["step"] if r["step"] is not None else "", _num(r["duration_s"]), r["devices"],
                 r["host"], r["run_dir"]]
            )  # fmt: skip
    return p


def _num(v: Any) -> str:
    return "" if v is None else f"{v:.6g}"
