"""A run's metrics as growable numpy columns, for plotting and CSV export. No Qt here.

Records arrive one at a time (live, from the worker's signals) or all at once (a past run's
metrics.jsonl); either way they land in the same columns, so the plots and the CSV see one shape.
"""

from __future__ import annotations

import csv
import json
import math
import pickle
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
from multilane.engine.rundir.runlog import load_metrics


class Column:
    """A float64 array that grows by doubling; ``.data`` is a view of the filled part."""

    def __init__(self, capacity: int = 1024) -> None:
        self._buf = np.empty(capacity, dtype=np.float64)
        self.n = 0

    def append(self, value: float) -> None:
        if self.n == len(self._buf):
            grown = np.empty(max(2 * len(self._buf), 1024), dtype=np.float64)
            grown[: self.n] = self._buf[: self.n]
            self._buf = grown
        self._buf[self.n] = value
        self.n += 1

    def __getstate__(self) -> dict:
        return {"data": self.data}  # the filled part only (an export's copy of a run: export.py)

    def __setstate__(self, state: dict) -> None:
        self._buf, self.n = state["data"], len(state["data"])

    def pad_to(self, n: int) -> None:
        while self.n < n:
            self.append(math.nan)

    @property
    def data(self) -> np.ndarray:
        return self._buf[: self.n]


def _num(v: Any) -> float:
    if isinstance(v, dict):
        v = v.get("mean")
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return math.nan
    try:
        return float(v)
    except OverflowError:  # an integer past float's range, from a hand-edited file
        return math.nan


class Series:
    """Named columns sharing one row index (``step`` and ``wall_time`` are columns like the others)."""

    def __init__(self) -> None:
        self.columns: dict[str, Column] = {}
        self.rows = 0

    def add(self, values: dict[str, float]) -> None:
        for k, v in values.items():
            col = self.columns.get(k)
            if col is None:
                col = self.columns[k] = Column()
                col.pad_to(self.rows)
            col.append(v)
        self.rows += 1
        for col in self.columns.values():
            col.pad_to(self.rows)

    def snapshot(self) -> Series:
        """The rows so far, apart from this series: later rows (or a cut) do not change it."""
        out = Series()
        for k, col in self.columns.items():
            c = out.columns[k] = Column(0)
            c._buf, c.n = col.data, col.n
        out.rows = self.rows
        return out

    def get(self, name: str) -> np.ndarray:
        col = self.columns.get(name)
        return col.data if col is not None else np.full(self.rows, np.nan)

    def names(self, prefix: str) -> list[str]:
        return [k for k in self.columns if k.startswith(prefix)]

    def truncate_after_step(self, step: float) -> None:
        """Drop rows whose step is above ``step`` (superseded by a resume from an earlier checkpoint)."""
        if "step" not in self.columns:
            return
        keep = int(np.searchsorted(self.get("step"), step, side="right"))
        for col in self.columns.values():
            col.n = min(col.n, keep)
        self.rows = min(self.rows, keep)


class RunData:
    """Everything the app plots for one run."""

    def __init__(self, name: str = "run") -> None:
        self.name = name
        self.train = Series()  # step, wall_time, loss, loss/<device>, lr, samples_per_s, tokens_per_s, phase/<name>
        self.eval = Series()  # step, wall_time, val_loss, metric/<name>
        self.telemetry = Series()  # wall_time, step, util/<device>, mem/<device>, alloc/<device>, ...
        self.events: list[dict[str, Any]] = []
        self.devices: list[str] = []
        self.t0: float | None = None
        self.last_step = 0
        self.skipped = 0  # unreadable lines of the run's metrics.jsonl, left out
        self.config: dict[str, Any] | None = None  # the run's config.json, for what differs between runs
        self.noise = Series()  # step, b_simple, batch, g2, trace (engine/health: the gradient noise scale)
        self.health: list[dict[str, Any]] = []  # the sampled steps' per-layer health records, in step order
        self.nan_origin: dict[str, Any] | None = None  # the "nonfinite_origin" event: where a NaN began

    def add(self, rec: dict[str, Any]) -> None:
        kind = rec.get("kind")
        wall = float(rec.get("wall_time") or 0.0)
        if self.t0 is None and wall:
            self.t0 = wall
        if kind == "train":
            self.last_step = int(rec["step"])
            row = {"step": rec["step"], "wall_time": wall, "loss": _num(rec.get("loss"))}
            device_loss = rec.get("device_loss") or {}
            self._meet(device_loss)
            for dev, v in device_loss.items():
                row[f"loss/{dev}"] = _num(v)
            for key in ("lr", "samples_per_s", "tokens_per_s", "step_ms", "grad_norm", "samples_per_j"):
                if key in rec:
                    row[key] = _num(rec[key])
            for phase, ms in (rec.get("phase_ms") or {}).items():
                row[f"phase/{phase}"] = _num(ms)
            self.train.add(row)
            noise = rec.get("noise")
            if isinstance(noise, dict):
                values = {k: _num(noise.get(k)) for k in ("b_simple", "batch", "g2", "trace")}
                self.noise.add({"step": rec["step"], **values})
        elif kind == "health":
            self.health.append(rec)
        elif kind == "eval":
            row = {"step": rec["step"], "wall_time": wall, "val_loss": _num(rec.get("val_loss"))}
            for k, v in (rec.get("metrics") or {}).items():
                row[f"metric/{k}"] = _num(v)
            if "perplexity" in rec:  # a language model's: drawn, hovered and exported as a metric
                row["metric/perplexity"] = _num(rec["perplexity"])
            self.eval.add(row)
        elif kind == "telemetry":
            step = _num(rec.get("step"))  # a ddp rank's record can arrive after a later train record
            row = {"wall_time": wall, "step": step if math.isfinite(step) else float(self.last_step)}
            devices = rec.get("devices") or {}
            self._meet(devices)
            for dev, d in devices.items():
                for src, dst in (
                    ("util_pct", "util"),
                    ("busy_pct", "util"),
                    ("mem_used_mb", "mem"),
                    ("torch_allocated_mb", "alloc"),
                    ("power_w", "power"),
                    ("temp_c", "temp"),
                    ("rss_mb", "rss"),  # a ddp rank's process
                ):
                    if src in d:
                        row[f"{dst}/{dev}"] = _num(d[src])
            proc = rec.get("process") or {}
            if "rss_mb" in proc:
                row["rss_mb"] = _num(proc["rss_mb"])
            if "cpu_pct" in proc:
                row["cpu_pct"] = _num(proc["cpu_pct"])
            self.telemetry.add(row)
        elif kind == "event":
            lanes = rec.get("lanes")
            if rec.get("event") == "started" and isinstance(lanes, list) and all(isinstance(n, str) for n in lanes):
                self.set_devices(lanes)
            if rec.get("resumed_from_step") is not None:
                s = float(rec["resumed_from_step"])
                self.train.truncate_after_step(s)
                self.eval.truncate_after_step(s)
                self.noise.truncate_after_step(s)
                self.health = [h for h in self.health if h["step"] <= s]
            if rec.get("event") == "nonfinite_origin":
                self.nan_origin = rec
            self.events.append(rec)

    def set_devices(self, names: Iterable[str]) -> None:
        """The run's device list, in its order (the config's, or the ``started`` event's ``lanes``): each
        device's colour is its place here, decided before any record is drawn and the same in every plot,
        the key, the hover and the exported figures. Devices met before the list keep their place after it."""
        names = list(dict.fromkeys(names))
        self.devices[:] = names + [d for d in self.devices if d not in names]

    def _meet(self, names: Iterable[str]) -> None:
        """Devices a record names that the list did not (a run without one): appended, in the record's order."""
        for dev in names:
            if dev not in self.devices:
                self.devices.append(dev)

    def device_index(self, dev: str) -> int:
        """A device's place in the run's device list: its colour (``palette.series_color``)."""
        return self.devices.index(dev) if dev in self.devices else len(self.devices)

    def snapshot(self) -> RunData:
        """The run as it is now, apart from this object: for work in another thread or process (an
        export) while records keep coming. The columns are views (no copy): rows are only ever appended."""
        out = RunData(self.name)
        out.__dict__.update(self.__dict__)
        out.train, out.eval, out.telemetry = self.train.snapshot(), self.eval.snapshot(), self.telemetry.snapshot()
        out.events, out.devices = list(self.events), list(self.devices)
        return out

    def extend(self, records: Iterable[dict[str, Any]]) -> None:
        for r in records:
            self.add(r)

    @classmethod
    def from_run_dir(cls, path: str | Path) -> RunData:
        p = Path(path)
        data = cls(p.name)
        try:
            config = json.loads((p / "config.json").read_text(encoding="utf-8"))
            data.config = config if isinstance(config, dict) else None
        except (OSError, ValueError):  # no config, or a damaged one: the run is still shown
            data.config = None
        data.set_devices(config_lanes(data.config))  # a run from before ``started`` named its lanes
        metrics = load_metrics(p)  # bad lines are skipped and counted, never fatal
        for rec in metrics.records:
            data.add(rec)
        data.skipped = metrics.skipped
        return data

    @property
    def throughput_key(self) -> str:
        """What the throughput plot draws: tokens/s for a run that logs them (a language model's), else samples/s."""
        return "tokens_per_s" if "tokens_per_s" in self.train.columns else "samples_per_s"

    @property
    def metric_names(self) -> list[str]:
        return [k.split("/", 1)[1] for k in self.eval.names("metric/")]

    def write_csv(self, path: str | Path) -> int:
        """Every logged train step with its columns, validation values joined on step, and the telemetry
        record that covers that step's time (utilization, memory, power, temperature; ``_latest_at``);
        returns rows."""
        train_cols = [k for k in self.train.columns if k not in ("step", "wall_time")]
        eval_cols = [k for k in self.eval.columns if k not in ("step", "wall_time")]
        tele_cols = [k for k in self.telemetry.columns if k not in ("step", "wall_time")]
        eval_by_step = {}
        steps = self.eval.get("step")
        for i, s in enumerate(steps):
            eval_by_step[int(s)] = {k: self.eval.get(k)[i] for k in eval_cols}
        with open(path, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(["step", "wall_time", "elapsed_s", *train_cols, *eval_cols, *tele_cols])
            t0 = self.t0 or 0.0
            tsteps, twall = self.train.get("step"), self.train.get("wall_time")
            tele = {k: _latest_at(self.telemetry.get("wall_time"), self.telemetry.get(k), twall) for k in tele_cols}
            for i in range(self.train.rows):
                ev = eval_by_step.get(int(tsteps[i]), {})
                w.writerow(
                    [
                        int(tsteps[i]),
                        f"{twall[i]:.3f}",
                        f"{twall[i] - t0:.3f}",
                        *(_fmt(self.train.get(k)[i]) for k in train_cols),
                        *(_fmt(ev.get(k, math.nan)) for k in eval_cols),
                        *(_fmt(tele[k][i]) for k in tele_cols),
                    ]
                )
        return self.train.rows

    def write_health_csv(self, path: str | Path) -> int:
        """Every sampled step's per-layer health, one row per (step, quantity, layer) — the long form
        a spreadsheet or pandas pivots — and the noise scale per logged step; returns rows."""
        n = 0
        with open(path, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(["step", "quantity", "layer", "value"])
            for rec in self.health:
                for rows_key, fields in HEALTH_FIELDS:
                    for q in fields:
                        for layer, v in zip(rec.get(rows_key) or [], rec.get(q) or [], strict=False):
                            w.writerow([rec["step"], q, layer, _fmt(_num(v))])
                            n += 1
            steps = self.noise.get("step")
            for key in ("b_simple", "batch", "g2", "trace"):
                for i, v in enumerate(self.noise.get(key)):
                    w.writerow([int(steps[i]), f"noise_{key}", "", _fmt(v)])
                    n += 1
        return n


HEALTH_FIELDS = (
    ("rows", ("grad_norm", "weight_norm", "update_ratio")),
    ("act_rows", ("act_mean", "act_std", "act_zero")),
)


def config_lanes(config: dict[str, Any] | None) -> list[str]:
    """The lane names a run's config asks for (``devices.use = "cpu:0,cpu:1"``), in its order; none
    for ``auto`` (decided on the machine that ran it), ddp and fsdp (ranks are named by host) or a bad value."""
    from multilane.engine.config import PROCESS_STRATEGIES

    section = (config or {}).get("devices")
    if not isinstance(section, dict) or section.get("strategy") in PROCESS_STRATEGIES:
        return []
    use = section.get("use")
    if not isinstance(use, str) or use.strip() in ("", "auto"):
        return []
    from multilane.engine.telemetry.devices import lane_names, parse_devices  # torch: only when asked

    try:
        return lane_names(parse_devices(use))
    except Exception:  # a damaged config: the records name the devices instead
        return []


def recorded(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A telemetry column's recorded points only. Under ddp each rank's record holds only its own
    devices, so a device's column is NaN on the other ranks' rows; drawn as is (NaN breaks a line)
    it would show nothing."""
    keep = np.isfinite(y)
    return (x, y) if keep.all() else (x[keep], y[keep])


def _latest_at(wall: np.ndarray, values: np.ndarray, at: np.ndarray) -> np.ndarray:
    """Each time in ``at``: the column's value from the telemetry record whose interval holds it — the
    first finite record at or after it (a record sums up the seconds before it) — or, after the last
    record, the last one; NaN where the column has none. A short run's train rows all come before its
    first (or only) record, and "the latest at or before" left them empty while plots.png drew the
    record. Telemetry records come one per ddp rank, each holding only its own devices, and a rank's
    record can reach the file after a later one of another rank, so rows are sorted and each column
    is looked up on its own."""
    order = np.argsort(wall, kind="stable")
    w, v = wall[order], values[order]
    keep = np.isfinite(v)
    w, v = w[keep], v[keep]
    if not len(v):
        return np.full(len(at), math.nan)
    j = np.minimum(np.searchsorted(w, at, side="left"), len(v) - 1)
    return v[j]


def _fmt(v: float) -> str:
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else repr(float(v))


def write_request(path: str | Path, request: dict) -> None:
    """Runs (in a dict) for another process, such as an export's (``gui/export/export_job.py``): one pickle whose numpy columns travel out of band (protocol 5),
    so that the caller's thread only describes them and the bytes are written by ``file.write``, which
    lets other threads run (the window's, while a million points are written)."""
    buffers: list[pickle.PickleBuffer] = []
    head = pickle.dumps(request, protocol=5, buffer_callback=buffers.append)
    with open(path, "wb") as f:
        f.write(struct.pack("<QQ", len(head), len(buffers)))
        f.write(head)
        for b in buffers:
            raw = b.raw()
            f.write(struct.pack("<Q", raw.nbytes))
            f.write(raw)


def read_request(path: str | Path) -> dict:
    with open(path, "rb") as f:
        n_head, n_buffers = struct.unpack("<QQ", f.read(16))
        head = f.read(n_head)
        buffers = []
        for _ in range(n_buffers):
            (n,) = struct.unpack("<Q", f.read(8))
            buf = bytearray(n)
            f.readinto(buf)
            buffers.append(buf)
    return pickle.loads(head, buffers=buffers)
