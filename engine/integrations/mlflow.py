"""MLflow's side of sending a run: ``Sender``, one run folder's records on their way to one MLflow run, in
batches (``MlflowClient.log_batch``), from a thread of its own (live) or in the caller's (export). The
senders of a run (the trainer's callback, the mirror's, the export) are in ``mlflow_logger``.

Training never waits for the server: the thread retries with a growing pause while the server is down,
slow or refuses; the first failure is one warning line, and what is still queued is sent when the
server answers again. At the run's end the thread gets ``END_WAIT_S`` to send the rest, config.json,
metrics.jsonl and the loss figure (PNG and PDF, drawn by ``multilane export`` in a process of its own),
then marks the run FINISHED, FAILED or KILLED (a stop, an abort, a NaN stop). A batch that may have been
stored though its answer was lost is read back before it is sent again (``missing_points``).

One MLflow run per run folder and server: its id is kept in the folder's ``mlflow.json`` and the run
carries the tag ``multilane.run_key`` (the folder's name and its first start), so a resumed run, a second
export or a copy of the folder updates the same MLflow run. Credentials: only MLflow's own environment
variables (``MLFLOW_TRACKING_USERNAME``/``_PASSWORD``/``_TOKEN``); the URI written into ``mlflow.json``
loses any user and password. Needs the ``[mlflow]`` extra; this module is the only one that imports it.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from multilane.engine.errors import UserError
from multilane.integrations import mlflow_records as mr
from multilane.integrations.extras import require

WHAT = "tracking.mlflow (logging to an MLflow server)"
FLUSH_S = 1.0  # the server sees the run at most about this late
BACKOFF_MAX_S = 8.0  # while the server fails: retry after 0.5 s, 1 s, 2 s, ... up to this
END_WAIT_S = 60.0  # at the run's end: at most this long to send the rest, the artifacts and the end state
BATCH_METRICS, BATCH_PARAMS, BATCH_TAGS = 1000, 100, 100  # MLflow's limits per log_batch
QUEUE_MAX = 2_000_000  # points held while the server is away (~200 MB); beyond, the oldest wait for an export
# MLflow's client retries a failed request 7 times with growing pauses (minutes); the sender retries on
# its own and must notice a server gone within seconds. Set only where the user has not.
# Nor print a "View run" line of its own onto the terminal from the sending thread.
HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "15",
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
}

mlflow = require("mlflow", "mlflow", WHAT)
from mlflow.entities import Metric, Param, RunTag  # noqa: E402  (after the one-line check of the extra)
from mlflow.tracking import MlflowClient  # noqa: E402


class Sender:
    """One run folder's records on its way to one MLflow run. ``start()`` sends from a thread of its own
    (live); ``send_now()`` sends in the caller's thread and raises on failure (export)."""

    def __init__(
        self,
        uri: str,
        experiment: str,
        run_dir: Path,
        key: str,
        tags: dict[str, str],
        on_problem: Callable[[str], None] | None = None,
        live: bool = True,
        hand_over_s: float | None = None,
        on_hand_over: Callable[[str], None] | None = None,
    ) -> None:
        for k, v in HTTP_DEFAULTS.items():
            os.environ.setdefault(k, v)
        self.uri, self.experiment, self.run_dir, self.key, self.live = uri, experiment, run_dir, key, live
        self.run_id: str | None = None
        self.parent_id: str | None = None
        self._tags = dict(tags)
        self._params: dict[str, str] = {}
        self._points: collections.deque[mr.Point] = collections.deque(maxlen=QUEUE_MAX)
        self._check: list[mr.Point] = []  # sent only where the server lacks them (read back first)
        self._artifacts: list[tuple[Path, str]] = []
        self._figures = False
        self._end: tuple[str, int] | None = None
        self._server_params: set[str] = set()
        self._cv = threading.Condition()
        self._closing = False
        self._on_problem = on_problem
        self.problem: str | None = None  # the first failure, in words
        self.dropped = 0  # points, params and tags the server refused for good
        self.reached = False  # one send went through
        # On a host (mlflow_logger.py): never reached within ``hand_over_s`` (or by the end), the sending is
        # handed to the mirror: ``on_hand_over(why)``, and this sender sends nothing more.
        self.hand_over_s, self._on_hand_over, self.handed_over = hand_over_s, on_hand_over, False
        self._client: Any = None
        self._thread: threading.Thread | None = None

    # -- what to send (any thread) -------------------------------------------------------------
    def add(
        self,
        points: list[mr.Point] = (),
        params: dict[str, str] | None = None,
        tags: dict | None = None,
        check: list[mr.Point] = (),
    ) -> None:
        """Queue ``points``; ``check``: points that may be on the server already, sent where it lacks them."""
        with self._cv:
            if self.handed_over:
                return
            self._check.extend(check)
            self._points.extend(points)
            self._params.update(params or {})
            self._tags.update(tags or {})

    def finish(self, status: str, end_ms: int, artifacts: list[tuple[Path, str]], figures: bool) -> None:
        with self._cv:
            if self.handed_over:  # the mirror sends the end
                return
            self._artifacts += artifacts
            self._figures = figures
            self._end = (status, end_ms)

    def pending(self) -> int:
        with self._cv:
            return (
                len(self._points)
                + len(self._check)
                + len(self._params)
                + len(self._tags)
                + len(self._artifacts)
                + (self._end is not None)
            )

    # -- the thread ----------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="multilane-mlflow", daemon=True)
        self._thread.start()

    def close(self, timeout: float = END_WAIT_S) -> bool:
        """Send what is left (the server gets one more try if it was failing) within ``timeout``; whether
        everything was sent."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        return self.pending() == 0 and not (self._thread and self._thread.is_alive())

    def _loop(self) -> None:
        delay, first = 0.0, True  # the first send at once: the run is on the server from its start
        t0 = time.monotonic()
        while True:
            with self._cv:
                if not first:
                    self._cv.wait_for(lambda: self._closing, timeout=delay or FLUSH_S)
                first = False
                closing = self._closing
            try:
                self.send_now()
                delay = 0.0
                self.reached = True
            except Exception as e:
                if self.hand_over_s is not None and not self.reached:
                    if closing or time.monotonic() - t0 >= self.hand_over_s:
                        self._hand_over(mr.reason(e))
                        return
                elif self.problem is None:
                    self.problem = mr.reason(e)
                    if self._on_problem is not None:
                        with contextlib.suppress(Exception):
                            self._on_problem(self.problem)
                delay = min(max(delay * 2, 0.5), BACKOFF_MAX_S)
                if closing:
                    return
            if closing and self.pending() == 0:
                return

    def _hand_over(self, why: str) -> None:
        with self._cv:  # the records stay in the run folder: the mirror sends them from there
            self.handed_over = True
            self._points.clear()
            self._check.clear()
            self._params.clear()
            self._tags.clear()
            self._artifacts.clear()
            self._end = None
        if self._on_hand_over is not None:
            with contextlib.suppress(Exception):
                self._on_hand_over(why)

    # -- sending -------------------------------------------------------------------------------
    def client(self) -> Any:
        if self._client is None:
            problem = mr.uri_problem(self.uri)
            if problem:
                raise UserError(problem)
            self._client = MlflowClient(tracking_uri=self.uri)
        return self._client

    def ensure_run(self) -> str:
        """The MLflow run of this folder: the recorded one, else the one tagged with its key, else a new one."""
        if self.run_id is not None:
            return self.run_id
        c = self.client()
        exp = c.get_experiment_by_name(self.experiment)
        if exp is None:
            try:
                exp_id = c.create_experiment(self.experiment)
            except Exception:  # created by another run a moment ago
                exp = c.get_experiment_by_name(self.experiment)
                if exp is None:
                    raise
                exp_id = exp.experiment_id
        else:
            exp_id = exp.experiment_id
        run = None
        recorded = mr.recorded_run_id(self.run_dir, self.uri)
        if recorded:
            with contextlib.suppress(Exception):
                run = c.get_run(recorded)
                if run.info.lifecycle_stage != "active":
                    run = None
        if run is None:
            key = self.key.replace("'", "\\'")
            found = c.search_runs([exp_id], filter_string=f"tags.`{mr.RUN_KEY_TAG}` = '{key}'", max_results=1)
            run = found[0] if found else None
        if run is None:
            tags = {mr.RUN_KEY_TAG: self.key}
            parent = mr.sweep_parent(self.run_dir)
            if parent is not None:  # a sweep's trial: nested under the sweep's run
                tags["mlflow.parentRunId"] = mr.parent_run(c, exp_id, *parent)
            run = c.create_run(exp_id, start_time=int(time.time() * 1000), tags=tags)
        else:
            self._server_params = set(run.data.params)  # MLflow refuses to change a param's value
            if self.live and run.info.status != "RUNNING":
                c.update_run(run.info.run_id, status="RUNNING")  # resumed: running again
        self.run_id = run.info.run_id
        self.parent_id = run.data.tags.get("mlflow.parentRunId")  # a sweep's trial
        if self.parent_id and self.live:  # a trial running: so is its sweep
            c.update_run(self.parent_id, status="RUNNING")
        mr.record_run_id(self.run_dir, self.uri, self.run_id, exp_id)
        return self.run_id

    def send_now(self) -> None:
        """Send everything queued; on a failure what was not sent stays queued and the error is raised."""
        run_id = self.ensure_run()
        c = self.client()
        with self._cv:
            check = list(self._check)
        if check:  # points the server may hold already: only those it lacks join the queue's front
            lacking = mr.missing_points(c, run_id, check)
            with self._cv:
                del self._check[: len(check)]
                self._points.extendleft(reversed(lacking))
        while True:
            with self._cv:
                params = {k: v for k, v in self._params.items() if k not in self._server_params}
                params = dict(list(params.items())[:BATCH_PARAMS])
                tags = dict(list(self._tags.items())[:BATCH_TAGS])
                points = [self._points.popleft() for _ in range(min(BATCH_METRICS, len(self._points)))]
            if not (params or tags or points):
                break
            try:
                c.log_batch(
                    run_id,
                    metrics=[Metric(k, v, ts, step) for k, v, ts, step in points],
                    params=[Param(k, v) for k, v in params.items()],
                    tags=[RunTag(k, v) for k, v in tags.items()],
                )
            except BaseException as e:
                if not _refused_for_good(e):
                    with self._cv:  # the server may have stored the batch before failing to answer: the
                        if mr.maybe_stored(e):  # next try reads back what it holds before sending again
                            self._check[:0] = points
                        else:
                            self._points.extendleft(reversed(points))
                    raise
                # the server refuses this batch itself (a 400): the rest must not wait behind it for ever
                self.dropped += len(points) + len(params) + len(tags)
                if self._on_problem is not None and self.problem is None:
                    self.problem = mr.reason(e)
                    with contextlib.suppress(Exception):
                        self._on_problem(f"a batch refused ({self.problem}), the rest is sent")
            with self._cv:
                self._server_params.update(params)
                for k in params:
                    self._params.pop(k, None)
                for k, v in tags.items():
                    if self._tags.get(k) == v:
                        del self._tags[k]
                self._params = {k: v for k, v in self._params.items() if k not in self._server_params}
        with self._cv:
            end, figures, artifacts = self._end, self._figures, list(self._artifacts)
        if end is None:
            return
        if figures:
            artifacts += mr.figures(self.run_dir)
            with self._cv:
                self._figures = False
                self._artifacts += artifacts[len(self._artifacts) :]
        for path, dest in artifacts:
            if path.is_file():
                c.log_artifact(run_id, str(path), dest or None)
            with self._cv:
                self._artifacts.remove((path, dest))
        c.set_terminated(run_id, status=end[0], end_time=end[1])
        if self.parent_id:  # the sweep's run ends with its last running trial
            query = f"tags.`mlflow.parentRunId` = '{self.parent_id}' and attributes.status = 'RUNNING'"
            exp_id = c.get_run(run_id).info.experiment_id
            if not c.search_runs([exp_id], filter_string=query, max_results=1):
                c.set_terminated(self.parent_id, status="FINISHED", end_time=end[1])
        with self._cv:
            self._end = None


_refused_for_good = mr.refused_for_good


# -- a run folder, sent (mlflow_logger.py) --------------------------------------------------------
def export_run(run_dir: Path, uri: str) -> str:
    from multilane.integrations.mlflow_logger import export_run as send

    return send(run_dir, uri)
