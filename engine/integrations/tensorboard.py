"""TensorBoard out and in: event files beside a run's metrics.jsonl, and any logdir read into the app.

Out: with ``train.tensorboard = true`` the run also writes TensorBoard event files into its own folder
(``torch.utils.tensorboard.SummaryWriter``), so ``tensorboard --logdir runs/`` shows each Multilane run
under its folder's name. Tags: ``train/loss``, ``train/device_loss/<device>``, ``train/lr`` (and the
other train numbers), ``val/loss``, ``val/<metric>``, ``telemetry/<reading>/<device>``,
``telemetry/process/<reading>``, ``train/noise_scale`` (B_simple) and per sampled step
``health/<quantity>/<layer>`` (engine/health). Steps and wall times are the records' own.

In: ``TensorBoardLogdir`` reads the event files of one TensorBoard run folder with TensorBoard's own
``EventFileLoader``, incrementally: each ``read()`` returns only the scalars appended since the last,
and a record still being written (a torn last record) is left for the next read, as the loader does.
Scalars become Multilane records (the tags above map back exactly; another logdir's tags by their
names: see ``record_for``), so a logdir is shown in the same plots and exported the same way. It only
reads: nothing is ever written into the logdir. Needs the ``[tensorboard]`` extra; this module is the
only one that imports TensorBoard.
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from multilane.engine.errors import UserError
from multilane.engine.run.callbacks import RunResult, TrainerCallback
from multilane.engine.rundir.records import HEALTH_ROWS, READINGS, metric_value
from multilane.integrations.extras import require

WHAT = "multilane.integrations.tensorboard (train.tensorboard, File → Open TensorBoard logdir)"
TRAIN_KEYS = ("lr", "samples_per_s", "step_ms", "grad_norm", "samples_per_j")
FLUSH_S = 5  # a live TensorBoard sees the run at most this late


tb = require("torch.utils.tensorboard", "tensorboard", WHAT, library="tensorboard")
event_file_loader = require(
    "tensorboard.backend.event_processing.event_file_loader", "tensorboard", WHAT, library="tensorboard"
)


class TensorBoardWriter(TrainerCallback):
    """Writes a run's records as TensorBoard scalars into ``log_dir`` (the run folder)."""

    def __init__(self, log_dir: str | Path) -> None:
        self.writer = tb.SummaryWriter(log_dir=str(log_dir), flush_secs=FLUSH_S)

    def _add(self, tag: str, value: Any, rec: dict[str, Any]) -> None:
        v = metric_value(value)
        if v is not None:
            self.writer.add_scalar(tag, v, global_step=rec.get("step") or 0, walltime=rec.get("wall_time"))

    def on_log(self, record: dict[str, Any]) -> None:
        self._add("train/loss", record.get("loss"), record)
        for dev, v in (record.get("device_loss") or {}).items():
            self._add(f"train/device_loss/{dev}", v, record)
        for key in TRAIN_KEYS:
            self._add(f"train/{key}", record.get(key), record)
        noise = record.get("noise") or {}
        self._add("train/noise_scale", noise.get("b_simple"), record)

    def on_health(self, record: dict[str, Any]) -> None:
        """Per layer (group), one scalar per quantity: ``health/<quantity>/<layer>``."""
        for rows_key, fields in HEALTH_ROWS.items():
            for f in fields:
                for row, v in zip(record.get(rows_key) or [], record.get(f) or [], strict=False):
                    self._add(f"health/{f}/{row}", v, record)

    def on_eval(self, record: dict[str, Any]) -> None:
        self._add("val/loss", record.get("val_loss"), record)
        for name, v in (record.get("metrics") or {}).items():
            self._add(f"val/{name}", v, record)

    def on_telemetry(self, record: dict[str, Any]) -> None:
        for dev, readings in (record.get("devices") or {}).items():
            for key in READINGS:
                if key in readings:
                    self._add(f"telemetry/{key}/{dev}", readings[key], record)
        for key, v in (record.get("process") or {}).items():
            self._add(f"telemetry/process/{key}", v, record)

    def on_train_end(self, result: RunResult) -> None:
        self.close()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


# -- in -------------------------------------------------------------------------------------------
def record_for(tag: str) -> tuple[str, str, str | None]:
    """Where a scalar goes: (record kind, field, device or metric name). Multilane's own tags map back
    exactly; another logdir's by name: a tag naming validation (val, valid, eval, test) is a validation
    loss when it names a loss, else a validation metric; one naming the learning rate is ``lr``; the
    first other loss-like tag is the train loss; every other scalar is shown as a metric."""
    parts = tag.split("/")
    if tag == "train/noise_scale":
        return "train", "noise", None
    if parts[0] == "health" and len(parts) >= 3 and parts[1] in HEALTH_FIELDS:
        return "health", parts[1], "/".join(parts[2:])
    if parts[0] == "train" and len(parts) >= 3 and parts[1] == "device_loss":
        return "train", "device_loss", "/".join(parts[2:])
    if parts[0] == "train" and len(parts) == 2 and parts[1] in ("loss", *TRAIN_KEYS):
        return "train", parts[1], None
    if parts[0] == "val" and len(parts) >= 2:
        rest = "/".join(parts[1:])
        return ("eval", "val_loss", None) if rest == "loss" else ("eval", "metrics", rest)
    if parts[0] == "telemetry" and len(parts) == 3 and parts[1] == "process":
        return "telemetry", parts[2], "process"
    if parts[0] == "telemetry" and len(parts) >= 3:
        return "telemetry", parts[1], "/".join(parts[2:])
    low = tag.lower()
    if low == "epoch":
        return "train", "epoch", None
    words = set(low.replace("/", "_").replace("-", "_").replace(".", "_").split("_"))
    if words & {"val", "valid", "validation", "eval", "test"}:
        return ("eval", "val_loss", None) if "loss" in low else ("eval", "metrics", tag)
    if words & {"lr", "learning"} or "learning_rate" in low:
        return "train", "lr", None
    if "loss" in low:
        return "train", "loss", tag
    return "eval", "metrics", tag


HEALTH_FIELDS = {f for fields in HEALTH_ROWS.values() for f in fields}


def _health_rows(rec: dict[str, Any]) -> None:
    """A health record's ``{quantity: {row: value}}`` as its rows and one list per quantity."""
    values = rec.pop("values", {})
    for rows_key, fields in HEALTH_ROWS.items():
        rows = list(dict.fromkeys(r for f in fields for r in values.get(f, {})))
        if rows:
            rec[rows_key] = rows
            for f in fields:
                if f in values:
                    rec[f] = [values[f].get(r) for r in rows]


class TensorBoardLogdir:
    """One TensorBoard run folder (its event files directly inside), read incrementally."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        if not self.path.is_dir():
            raise UserError(f"tensorboard: {self.path} is not a folder")
        self._loader_cls = event_file_loader.EventFileLoader
        self._loaders: dict[Path, Any] = {}
        self._scalar_tags: set[str] = set()
        self._train_loss_tag: str | None = None
        # The rows of the last step read: its other tags may still be on their way (held until a later
        # step, or a read that brings nothing new, shows the step complete).
        self._pending: dict[tuple[Any, ...], dict[str, Any]] = {}
        if not self._files():
            subs = sorted(p.name for p in self.path.iterdir() if p.is_dir() and any(p.glob("*tfevents*")))
            hint = f"; open one of its runs: {', '.join(subs[:5])}" if subs else ""
            raise UserError(f"tensorboard: {self.path} holds no event files (events.out.tfevents.*){hint}")

    def _files(self) -> list[Path]:
        return sorted(p for p in self.path.glob("*tfevents*") if p.is_file())

    def read(self) -> list[dict[str, Any]]:
        """The scalars appended since the last read, as Multilane records (by step, then kind)."""
        scalars: list[tuple[str, float, int, float]] = []
        for f in self._files():
            loader = self._loaders.get(f)
            if loader is None:
                loader = self._loaders[f] = self._loader_cls(str(f))
            with contextlib.suppress(Exception):  # a file removed or unreadable: the rest still count
                for event in loader.Load():
                    for v in event.summary.value:
                        x = self._scalar(v)
                        if x is not None:
                            scalars.append((v.tag, x, int(event.step), float(event.wall_time)))
        return self._records(scalars)

    def _scalar(self, v: Any) -> float | None:
        if v.HasField("metadata") and v.metadata.plugin_data.plugin_name == "scalars":
            self._scalar_tags.add(v.tag)
        if v.tag not in self._scalar_tags or not v.HasField("tensor"):
            return None
        t = v.tensor
        vals = list(t.float_val) or list(t.double_val)
        if len(vals) != 1:
            return None
        return float(vals[0])

    def _records(self, scalars: list[tuple[str, float, int, float]]) -> list[dict[str, Any]]:
        rows: dict[tuple[Any, ...], dict[str, Any]] = defaultdict(dict, self._pending)
        self._pending = {}
        for tag, x, step, wall in scalars:
            kind, field, name = record_for(tag)
            if kind == "train" and field == "loss" and name is not None:
                if self._train_loss_tag is None:
                    self._train_loss_tag = tag
                if tag != self._train_loss_tag:  # a second loss-like tag: shown as a metric of its own
                    kind, field = "eval", "metrics"
            rec = rows[(kind, step, wall) if kind == "telemetry" else (kind, step)]
            rec.setdefault("kind", kind)
            rec.setdefault("step", step)
            rec["wall_time"] = max(wall, rec.get("wall_time", wall))
            if field in ("device_loss", "metrics"):
                rec.setdefault(field, {})[name or tag] = x
            elif kind == "telemetry":
                rec.setdefault("devices", {}).setdefault(name, {})[field] = x
            elif kind == "health":
                rec.setdefault("values", {}).setdefault(field, {})[name] = x
            elif field == "noise":
                rec["noise"] = {"b_simple": x}
            else:
                rec[field] = x
        if scalars:
            last = max(step for _, _, step, _ in scalars)
            self._pending = {k: rows.pop(k) for k in list(rows) if k[1] == last}
        out = []
        for rec in rows.values():
            if rec["kind"] == "telemetry" and "process" in rec.get("devices", {}):
                rec["process"] = rec["devices"].pop("process")
            if rec["kind"] == "train" and "loss" not in rec and "device_loss" in rec:
                rec["loss"] = sum(rec["device_loss"].values()) / len(rec["device_loss"])
            if rec["kind"] == "train" and "loss" not in rec:
                rec["loss"] = math.nan  # an lr alone: the loss plot shows a gap, never a made-up value
            if rec["kind"] == "health":
                _health_rows(rec)
            out.append(rec)
        order = {"train": 0, "eval": 1, "telemetry": 2, "health": 3}
        return sorted(out, key=lambda r: (r["step"], order[r["kind"]]))
