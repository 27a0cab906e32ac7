"""A run folder's records as MLflow sees them: metric points, params, tags, the end state, the run's identity.

Plain functions, no MLflow import (``multilane.integrations.mlflow`` sends what they return; the errors it
meets are put in words by ``reason``, the figures drawn by ``figures``), so that a live
run and ``multilane export RUN --mlflow URI`` produce the very same points from the same records: a point
is ``(key, value, timestamp_ms, step)`` with the record's own step and wall time, and a re-send skips the
points the server already holds (same key, step and timestamp).

Names: ``loss``, ``loss/<device>`` (``cpu:0`` becomes ``cpu_0``: MLflow accepts letters, digits, ``_ - . /``
and spaces), ``lr``, ``samples_per_s``, ``tokens_per_s``, ``step_ms``, ``grad_norm``, ``samples_per_j``,
``noise_scale`` (B_simple), ``val_loss``, ``val/<metric>``, ``telemetry/<reading>/<device>`` and
``telemetry/process/<reading>`` (at most one telemetry record every ``TELEMETRY_EVERY_S`` of wall time).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from multilane.engine.errors import UserError
from multilane.engine.rundir.records import READINGS, metric_value
from multilane.engine.rundir.runread import iter_metrics

TRAIN_KEYS = ("lr", "samples_per_s", "tokens_per_s", "step_ms", "grad_norm", "samples_per_j")
TELEMETRY_EVERY_S = 5.0
"""Telemetry reaches the server at most once every this many seconds (the run folder keeps every record)."""
RUN_FILE = "mlflow.json"
"""In the run folder: the MLflow run this run was sent to, per server (no credentials: the URI's user and
password are left out)."""
END_STATUS = {"finished": "FINISHED", "failed": "FAILED"}
"""A run's end as MLflow's status; every other end (stopped, aborted, diverged) is KILLED."""
KILLED = "KILLED"
RUN_KEY_TAG = "multilane.run_key"
SWEEP_KEY_TAG = "multilane.sweep_key"  # on a sweep's parent run; its trials' runs are nested under it
FIGURE_TIMEOUT_S = 120.0
PARAM_MAX = 6000  # MLflow's limit on a param's value
NAME_MAX = 250  # and on a metric's or param's name
MIRROR_ENV = "MULTILANE_MLFLOW_MIRROR"
"""Set to 1 by ``train --host`` for the run on the host: a server the host does not reach is handed to the mirror."""
HAND_OVER_S = 3.0
"""On a host: the server not reached once within this long from the run's start (or by its end) is handed over."""
HAND_OVER_FIELD = "mlflow_mirror"
"""In the warning event that hands the sending to the mirror: the server's URI (without credentials)."""
SCHEMES = ("http", "https", "file", "databricks", "sqlite", "postgresql", "mysql", "mssql")

Point = tuple[str, float, int, int]


def mlflow_callback(config: Any) -> Callable[[Path], Any] | None:
    """Where ``tracking.mlflow`` is set: a maker of the run's ``MlflowLogger`` from its folder (the trainer
    attaches it to the rank that writes the folder). ``UserError``, one line, where the extra is missing."""
    uri = config.tracking.mlflow
    if not uri:
        return None
    from multilane.integrations.extras import MissingExtra

    try:
        import multilane.integrations.mlflow  # noqa: F401 (the extra is there)
        from multilane.integrations.mlflow_logger import MlflowLogger
    except MissingExtra as e:
        raise UserError(str(e)) from None
    return lambda run_dir: MlflowLogger(uri, config.tracking.experiment, run_dir, config.to_dict())


def metric_name(*parts: str) -> str:
    """``loss/cpu:0`` -> ``loss/cpu_0``: every character MLflow refuses becomes ``_``."""
    return "/".join(re.sub(r"[^A-Za-z0-9_\-. ]", "_", p) for p in parts)[:NAME_MAX]


def end_status(state: str) -> str:
    return END_STATUS.get(state, KILLED)


class PointMaker:
    """Records to metric points; telemetry thinned to one record every ``TELEMETRY_EVERY_S`` (by the
    records' own wall time, so that a live run and an export thin the same way)."""

    def __init__(self) -> None:
        self._telemetry_at = -math.inf

    def points(self, rec: dict[str, Any]) -> list[Point]:
        kind = rec.get("kind")
        step = rec.get("step")
        wall = rec.get("wall_time")
        if not isinstance(step, int) or isinstance(step, bool) or metric_value(wall) is None:
            return []
        ts = round(float(wall) * 1000)
        out: list[Point] = []

        def add(key: str, v: Any) -> None:
            x = metric_value(v)
            if x is not None:
                out.append((key, x, ts, step))

        if kind == "train":
            add("loss", rec.get("loss"))
            for dev, v in (rec.get("device_loss") or {}).items():
                add(metric_name("loss", str(dev)), v)
            for key in TRAIN_KEYS:
                add(key, rec.get(key))
            noise = rec.get("noise")
            if isinstance(noise, dict):
                add("noise_scale", noise.get("b_simple"))
        elif kind == "eval":
            add("val_loss", rec.get("val_loss"))
            for name, v in (rec.get("metrics") or {}).items():
                add(metric_name("val", str(name)), v)
        elif kind == "telemetry":
            if float(wall) - self._telemetry_at < TELEMETRY_EVERY_S:
                return []
            self._telemetry_at = float(wall)
            for dev, readings in (rec.get("devices") or {}).items():
                for key in READINGS:
                    if isinstance(readings, dict) and key in readings:
                        add(metric_name("telemetry", key, str(dev)), readings[key])
            for key, v in (rec.get("process") or {}).items():
                add(metric_name("telemetry", "process", str(key)), v)
        return out


def flat_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """The config as ``{"optim.lr": "0.003", "task.params.n": "512", ...}`` (MLflow's params are strings)."""
    out: dict[str, str] = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flat_params(v, key + "."))
        else:
            text = v if isinstance(v, str) else json.dumps(v)
            out[metric_name(key)] = text[:PARAM_MAX]
    return out


def run_tags(
    run_dir: Path, config: dict[str, Any], lanes: list[str] | None, host: str | None, version: str | None = None
) -> dict[str, str]:
    """The run's tags; ``host`` and ``version`` are those that made the run (environment.json's, for a
    past run), by default this machine's and this Multilane's."""
    from multilane.engine import __version__

    devices = config.get("devices") or {}
    name, path = folder_identity(run_dir)
    tags = {
        "mlflow.runName": name,
        "multilane.task": str((config.get("task") or {}).get("name", "")),
        "multilane.strategy": str(devices.get("strategy", "")),
        "multilane.devices": ",".join(lanes) if lanes else str(devices.get("use", "")),
        "multilane.host": host or socket.gethostname(),
        "multilane.version": version or __version__,
        "multilane.run_dir": path,
    }
    return {k: v[:PARAM_MAX] for k, v in tags.items()}


def sweep_parent(run_dir: Path) -> tuple[str, dict[str, str]] | None:
    """For a sweep's trial (its folder in a sweep folder, beside ``sweep.json``): the key and tags of the
    sweep's parent run. The key is the study's name and its storage (a shared PostgreSQL study: one
    parent for the trials of every ``sweep-worker``), else the sweep folder's name."""
    try:
        data = json.loads((run_dir.parent / "sweep.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    study = str(data.get("study") or run_dir.parent.name)
    key = f"sweep:{study}@{data.get('storage') or run_dir.parent.name}"[:PARAM_MAX]
    return key, {"mlflow.runName": f"sweep {study}", "multilane.sweep": study, SWEEP_KEY_TAG: key}


def parent_run(c: Any, exp_id: str, key: str, tags: dict[str, str]) -> str:
    """The sweep's parent run: found by its key, else made. Two trials making it at once: the older
    one stays and the other is deleted."""
    quoted = key.replace("'", "\\'")
    query = f"tags.`{SWEEP_KEY_TAG}` = '{quoted}'"
    found = c.search_runs([exp_id], filter_string=query, order_by=["attributes.start_time ASC"], max_results=5)
    if found:
        return found[0].info.run_id
    mine = c.create_run(exp_id, start_time=int(time.time() * 1000), tags=tags).info.run_id
    first = c.search_runs([exp_id], filter_string=query, order_by=["attributes.start_time ASC"], max_results=5)
    if first and first[0].info.run_id != mine:
        with contextlib.suppress(Exception):
            c.delete_run(mine)
        return first[0].info.run_id
    return mine


def first_started(run_dir: Path) -> float | None:
    """The wall time of the folder's first ``started`` event (a resumed run's is in its first lines)."""
    for rec in iter_metrics(run_dir / "metrics.jsonl"):
        if rec.get("kind") == "event" and rec.get("event") == "started" and isinstance(rec.get("wall_time"), float):
            return rec["wall_time"]
    return None


def folder_identity(run_dir: Path) -> tuple[str, str]:
    """The run folder's name and path where it trains: a mirror's are its host's folder's (``remote.json``),
    so that the host, the mirror and an export of either name one MLflow run."""
    from multilane.engine.remote.mirror import read_remote_json

    remote = read_remote_json(run_dir) or {}
    there = remote.get("path")
    if isinstance(there, str) and there.strip("/"):
        return there.rstrip("/").rsplit("/", 1)[-1], there
    return run_dir.name, str(run_dir.resolve())


def run_key(run_dir: Path, started_wall_time: float) -> str:
    """The run folder's identity on a server: its name (where it trains) and the wall time its first
    ``started`` event records (the same for the live run, its resumptions, a copy of the folder, its
    mirror and an export)."""
    return f"{folder_identity(run_dir)[0]}@{started_wall_time!r}"


def public_uri(uri: str) -> str:
    """The URI without a user or password (what may be written into the run folder or printed)."""
    try:
        parts = urlsplit(uri)
    except ValueError:
        return "(unparsable URI)"
    netloc = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def uri_problem(uri: str) -> str | None:
    """Why MLflow could not use ``uri``, or None."""
    try:
        scheme = urlsplit(uri).scheme.split("+")[0].lower()
    except ValueError as e:
        return f"not a URI ({e})"
    if scheme not in SCHEMES:
        return f"unknown scheme {scheme + '://' if scheme else '(none)'}, use http:// or https://"
    return None


def read_run_file(run_dir: Path) -> dict[str, Any]:
    try:
        data = json.loads((run_dir / RUN_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def recorded_run_id(run_dir: Path, uri: str) -> str | None:
    entry = (read_run_file(run_dir).get("servers") or {}).get(public_uri(uri))
    run_id = entry.get("run_id") if isinstance(entry, dict) else None
    return run_id if isinstance(run_id, str) and re.fullmatch(r"[0-9A-Za-z_-]{1,64}", run_id) else None


def record_run_id(run_dir: Path, uri: str, run_id: str, experiment_id: str) -> None:
    """Write (atomically) which MLflow run this folder went to on ``uri``; quietly nothing where the
    folder cannot be written (a read-only copy): the run is then found by its ``RUN_KEY_TAG``."""
    data = read_run_file(run_dir)
    servers = data.get("servers") if isinstance(data.get("servers"), dict) else {}
    servers[public_uri(uri)] = {"run_id": run_id, "experiment_id": experiment_id}
    tmp = run_dir / f".{RUN_FILE}.{os.getpid()}.tmp"
    try:
        tmp.write_text(json.dumps({"servers": servers}, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, run_dir / RUN_FILE)
    except OSError:
        tmp.unlink(missing_ok=True)


def reason(e: BaseException) -> str:
    """An MLflow or connection error as a few words (its message can hold a whole HTTP body)."""
    text = str(e)
    m = re.search(r"(?:status|error) code (\d{3})|too many (\d{3}) error responses", text)
    if m:
        code = m.group(1) or m.group(2)
        if code == "401":
            return "credentials refused (401): set MLFLOW_TRACKING_USERNAME/PASSWORD or MLFLOW_TRACKING_TOKEN"
        return f"the server answered {code}" + (" (permission refused)" if code == "403" else "")
    for needle, words in (
        ("Connection refused", "connection refused"),
        ("timed out", "no answer in time"),
        ("Name or service not known", "unknown host"),
        ("nodename nor servname", "unknown host"),
        ("Could not find a registered", "not a tracking URI MLflow knows"),
    ):
        if needle in text:
            return words
    first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
    return first if len(first) <= 120 else first[:117] + "..."


_TMP: list[tempfile.TemporaryDirectory] = []  # the figures' folders, removed at exit (after the upload)


def figures(run_dir: Path) -> list[tuple[Path, str]]:
    """The loss figure (PNG and PDF) drawn by ``multilane export`` in a process of its own (matplotlib
    holds the GIL for seconds; the app's export does the same), as (file, artifact folder); none where
    it fails."""
    tmp = tempfile.TemporaryDirectory(prefix="multilane-mlflow-")
    _TMP.append(tmp)
    cmd = [sys.executable, "-m", "multilane.engine.cli", "export", str(run_dir), "--out", tmp.name]
    with contextlib.suppress(Exception):
        subprocess.run(
            [*cmd, "--format", "png,pdf"], capture_output=True, timeout=FIGURE_TIMEOUT_S, stdin=subprocess.DEVNULL
        )
    out = [Path(tmp.name) / f"loss.{fmt}" for fmt in ("png", "pdf")]
    return [(p, "figures") for p in out if p.is_file()]


def artifacts(run_dir: Path) -> list[tuple[Path, str]]:
    """The run folder's files sent at the end, as (file, artifact folder: the top)."""
    return [(run_dir / "config.json", ""), (run_dir / "metrics.jsonl", "")]


def missing_points(client: Any, run_id: str, points: list[Point]) -> list[Point]:
    """The points the run lacks (same key, step and timestamp: one record's point). A SQL-backed server
    keeps one copy of an identical point (its primary key is the key, step, timestamp and value), but a
    file-backed one appends every value logged: what may be there is read back, never sent blind.
    Only the histories of the keys ``points`` hold are read."""
    have_keys = set(client.get_run(run_id).data.metrics) & {p[0] for p in points}
    held: dict[str, set[tuple[int, int]]] = {}
    for k in have_keys:
        held[k] = {(m.step, m.timestamp) for m in client.get_metric_history(run_id, k)}
    return [p for p in points if (p[3], p[2]) not in held.get(p[0], ())]


def maybe_stored(e: BaseException) -> bool:
    """Whether a failed request may have been stored all the same (sent, then no answer: the server
    committed and died, the connection dropped, the answer timed out); a refused connection or an
    unknown host sent nothing."""
    text = str(e)
    if "NewConnectionError" in text or "NameResolutionError" in text:  # no connection was ever made
        return False
    return reason(e) not in ("connection refused", "unknown host")


def refused_for_good(e: BaseException) -> bool:
    """A 4xx answer to the request itself (bad value, bad name): sending it again cannot help. Credentials
    (401, 403), a missing endpoint (404) and throttling (408, 429) may change: those are retried."""
    try:
        code = int(e.get_http_status_code())  # type: ignore[attr-defined]
    except Exception:
        return False
    return 400 <= code < 500 and code not in (401, 403, 404, 408, 429)
