"""The runs table's rows: one summary per run folder under a runs folder. No Qt here.

What W&B's runs table and TensorBoard's HParams view show: status, the hyperparameters people vary,
final and best metrics, duration. Read from each folder's status.json, config.json and metrics.jsonl;
a folder that cannot be read becomes a row saying so, never an error.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from multilane.engine.rundir.runlog import iter_metrics
from multilane.engine.rundir.runs_folder import read_meta
from multilane.gui.runs.run_summary import TrainingClock

COLUMNS = [
    ("name", "run"),
    ("tags", "tags"),  # beside the name: seen without scrolling (the note, longer, comes last)
    ("status", "status"),
    ("task", "task"),
    ("strategy", "strategy"),
    ("devices", "devices"),
    ("batch", "batch"),
    ("optimizer", "optimizer"),
    ("lr", "lr"),
    ("steps", "steps"),
    ("final_loss", "loss"),  # the last logged training loss (its header's tooltip says so)
    ("best_val_loss", "best val"),
    ("final_metric", "final metric"),
    ("tokens_per_s", "tokens/s"),  # a language model's run; blank for others
    ("best_perplexity", "best ppl"),
    ("duration_s", "training time"),
    ("note", "note"),
]
# What decides a comparison, shown by default (they fit beside the plots at 1280 px); the others are a
# right-click on the header away, and the search reads them all.
MAIN_COLUMNS = ("name", "status", "strategy", "devices", "batch", "lr", "final_loss", "best_val_loss")
LM_COLUMNS = ("tokens_per_s", "best_perplexity")
"""Shown by themselves once a run in the table logs them (a language model's), hidden while none does."""


@dataclass
class RunSummary:
    path: Path
    name: str
    status: str = "?"
    task: str = ""
    devices: str = ""
    strategy: str = ""
    batch: float = math.nan
    optimizer: str = ""
    lr: float = math.nan
    steps: str = ""
    step: float = math.nan  # the steps column sorts by this, not by its text ("100/200" after "20/200")
    final_loss: float = math.nan
    best_val_loss: float = math.nan
    final_metric: float = math.nan
    metric_name: str = ""
    tokens_per_s: float = math.nan  # the mean of the train records' tokens/s
    best_perplexity: float = math.nan
    duration_s: float = math.nan
    started: float = 0.0
    tags: str = ""  # meta.json's tags, comma-separated (engine/rundir/runs_folder.py)
    note: str = ""
    notes: list[str] = field(default_factory=list)

    def value(self, key: str) -> Any:
        return getattr(self, key)


def lm_columns(rows: list[RunSummary], hidden: list[str], shown_before: bool) -> tuple[bool, list[str]]:
    """Whether a run among ``rows`` logs a language model's numbers (tokens/s, perplexity), and the table's
    hidden columns after that: the language model's shown once one does, hidden while none does, changed
    only when that changes (so what the columns menu chose otherwise stays)."""
    shown = any(math.isfinite(r.tokens_per_s) or math.isfinite(r.best_perplexity) for r in rows)
    if shown == shown_before:
        return shown, hidden
    return shown, [*(k for k in hidden if k not in LM_COLUMNS), *(() if shown else LM_COLUMNS)]


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def summarize(run_dir: str | Path) -> RunSummary:
    """One run folder as a row of the runs table."""
    p = Path(run_dir)
    s = RunSummary(p, p.name)
    status = _read_json(p / "status.json")
    s.status = str(status.get("state") or "?")
    step, total = status.get("step"), status.get("total_steps")
    s.steps = f"{step}/{total}" if step is not None and total else (str(step) if step is not None else "")
    if isinstance(step, int):
        s.step = float(step)
    cfg = _read_json(p / "config.json")
    try:
        s.task = str(cfg["task"]["name"])
        s.devices = str(cfg["devices"]["use"])
        s.strategy = str(cfg["devices"].get("strategy") or "replicate")
        s.batch = float(cfg["data"]["batch_size"])
        s.optimizer = str(cfg["optim"]["name"])
        s.lr = float(cfg["optim"]["lr"])
    except (KeyError, TypeError, ValueError):
        s.notes.append("no readable config.json")
    meta = read_meta(p)
    s.tags, s.note = ", ".join(meta["tags"]), meta["note"]
    first = None
    tokens: list[float] = []
    clock = TrainingClock()  # training time: what the window's status line says too
    try:
        for rec in iter_metrics(p / "metrics.jsonl"):
            clock.add(rec)
            wall = rec.get("wall_time")
            if isinstance(wall, (int, float)) and first is None:
                first = wall
            kind = rec.get("kind")
            if kind == "train" and isinstance(rec.get("loss"), (int, float)):
                s.final_loss = float(rec["loss"])
            if kind == "train" and isinstance(rec.get("tokens_per_s"), (int, float)):
                tokens.append(float(rec["tokens_per_s"]))
            elif kind == "eval":
                ppl = rec.get("perplexity")
                if isinstance(ppl, (int, float)) and math.isfinite(ppl):
                    s.best_perplexity = ppl if math.isnan(s.best_perplexity) else min(s.best_perplexity, ppl)
                v = rec.get("val_loss")
                if isinstance(v, (int, float)) and math.isfinite(v):
                    s.best_val_loss = v if math.isnan(s.best_val_loss) else min(s.best_val_loss, v)
                for k, m in (rec.get("metrics") or {}).items():
                    if isinstance(m, (int, float)):
                        s.metric_name, s.final_metric = str(k), float(m)
                        break
    except (OSError, ValueError):
        s.notes.append("metrics.jsonl unreadable")
    if first is not None:
        s.started, s.duration_s = first, clock.seconds()
    if tokens:
        s.tokens_per_s = sum(tokens) / len(tokens)
    return s


def _stamp(folder: Path) -> tuple:
    """What changes when a run's row may: its metrics' size, its status and its meta.json."""
    out: list = []
    for name in ("metrics.jsonl", "status.json", "meta.json", "config.json"):
        try:
            st = (folder / name).stat()
            out.append((st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError:
            out.append(None)
    return tuple(out)


def list_runs(runs_dir: str | Path, cache: dict[Path, tuple[tuple, RunSummary]] | None = None) -> list[RunSummary]:
    """Every run folder directly under ``runs_dir`` (a folder with metrics.jsonl), newest first.
    With ``cache`` (kept by the caller between calls), only folders that changed are read again."""
    root = Path(runs_dir)
    try:
        folders = [d for d in root.iterdir() if d.is_dir() and (d / "metrics.jsonl").exists()]
    except OSError:
        return []
    rows = []
    for d in folders:
        stamp = _stamp(d)
        hit = cache.get(d) if cache is not None else None
        row = hit[1] if hit is not None and hit[0] == stamp else summarize(d)
        if cache is not None:
            cache[d] = (stamp, row)
        rows.append(row)
    if cache is not None:
        for gone in set(cache) - set(folders):
            del cache[gone]
    rows.sort(key=lambda r: (r.started, r.name), reverse=True)
    return rows


def runs_signature(runs_dir: str | Path) -> tuple:
    """Cheap: changes when a run folder comes or goes, or a run's status or meta changes (a start, an
    end, a tag). The runs table polls it to refresh by itself."""
    root = Path(runs_dir)
    try:
        names = sorted(d.name for d in root.iterdir() if d.is_dir())
    except OSError:
        return ()
    sig = []
    for name in names:
        for f in ("status.json", "meta.json", "metrics.jsonl"):
            try:
                st = (root / name / f).stat()
                sig.append((name, f, st.st_mtime_ns, st.st_ino) if f != "metrics.jsonl" else (name, f))
            except OSError:
                pass
    return tuple(sig)
