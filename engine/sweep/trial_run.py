"""One trial in one slot: an ordinary ``multilane train`` process with the trial's config, on the slot's
devices only, writing an ordinary run folder inside the sweep folder.

The trial process knows nothing of Optuna. This side follows its ``metrics.jsonl``, reports each
evaluation's objective to the study (``trial.report``) and, when the pruner says so, stops it through
its control file (the run ends "stopped" with a checkpoint, like any stopped run) and records it pruned.
One place speaks to the storage, so a trial process needs no database driver and no Optuna."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from multilane.engine.config import build_config, merge
from multilane.engine.distributed import RUN_DIR_ENV
from multilane.engine.rundir.control_file import write_control
from multilane.engine.rundir.follow import TERMINAL_STATES, MetricsTail
from multilane.engine.rundir.runlog import CONFIG, STATUS
from multilane.engine.start.parent_death import sigterm_with_parent
from multilane.engine.start.server import start_cli, start_way
from multilane.engine.sweep.trial_guard import TrialGuard, grace_s, kill_tree, signal_group

TRAIN = [sys.executable, "-m", "multilane.engine.cli", "train"]
CONSOLE = "console.log"
POLL_S = 0.25
TRIAL_START_ENV = "MULTILANE_TRIAL_START"  # forkserver (the default) or exec: how trials start
REQUEST = "sweep_request.json"  # "prune" or "stop" asked from outside (the app's trials table)


def request_trial(run_dir: str | Path, action: str) -> None:
    """Prune or stop one running trial from another process: the sweep that runs it records it as asked
    (pruned, or failed "stopped by hand"); the trial itself stops through its control file."""
    if action not in ("prune", "stop"):
        raise ValueError(action)
    folder = Path(run_dir)
    tmp = folder / f".{REQUEST}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"action": action, "time": time.time()}) + "\n")
    os.replace(tmp, folder / REQUEST)
    write_control(folder, "stop", "pruned by hand" if action == "prune" else "stopped by hand")


def requested(run_dir: Path) -> str | None:
    try:
        action = json.loads((run_dir / REQUEST).read_text(encoding="utf-8")).get("action")
    except (OSError, ValueError, AttributeError):
        return None
    return action if action in ("prune", "stop") else None


@dataclass
class TrialOutcome:
    state: str  # "complete", "pruned", "failed", "interrupted", "lost"
    value: float | None = None
    message: str | None = None


def objective_value(record: dict[str, Any], name: str) -> float | None:
    """The objective in one metrics record: a top-level field (val_loss, loss) or one of the task's metrics."""
    if record.get("kind") not in ("eval", "train"):
        return None
    v = record.get(name)
    if v is None and isinstance(record.get("metrics"), dict):
        v = record["metrics"].get(name)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def trial_config(
    base: dict[str, Any], params: dict[str, Any], task: str, devices: str, folder: Path, number: int
) -> Any:
    """The trial's config: the sweep's base config (nested), the trial's params (dotted keys), its slot's
    devices, its run folder's name."""
    overrides = {"task.name": task, **params, "devices.use": devices}
    overrides["run.runs_dir"] = str(folder)
    overrides["run.name"] = f"trial-{number:04d}"
    return build_config(merge(base, overrides), f"trial {number}")


class TrialProcess:
    """A running trial: its process, its run folder and the metrics read so far."""

    def __init__(self, config: Any, run_dir: Path, threads: int | None = None) -> None:
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=False)
        (run_dir / "checkpoints").mkdir()
        (run_dir / CONFIG).write_text(json.dumps(config.to_dict(), indent=2) + "\n")
        env = {**os.environ, RUN_DIR_ENV: str(run_dir)}
        if threads:  # CPU slots share the cores instead of each taking them all
            env["OMP_NUM_THREADS"] = str(threads)
        argv = [*TRAIN, "--config", str(run_dir / CONFIG)]
        with open(run_dir / CONSOLE, "ab") as log:
            if start_way(TRIAL_START_ENV) == "forkserver":
                with open(os.devnull, "rb") as null:
                    self.proc: Any = start_cli(
                        argv,
                        stdin=null.fileno(),
                        stdout=log.fileno(),
                        stderr=log.fileno(),
                        env=env,
                        new_session=True,  # its own group: the sweep (and its guard) stop all of it
                        signal_when_i_end=signal.SIGTERM,  # a stop with a checkpoint when the sweep dies
                    )
            else:
                self.proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    preexec_fn=sigterm_with_parent,
                    start_new_session=True,
                )
        try:
            self.guard = TrialGuard(self.proc.pid)
        except BaseException:  # no guard, no trial: it is never left running unguarded
            kill_tree(self.proc.pid)
            self.proc.wait()
            raise
        self.tail = MetricsTail(run_dir / "metrics.jsonl")
        self.step = 0
        self.started = time.time()
        self._stop_at: float | None = None  # when this side asked it to stop
        self._terminated = False

    def new_values(self, objective: str) -> list[tuple[int, float]]:
        """(step, value) of the objective in the records written since the last call."""
        out = []
        for rec in self.tail.read():
            step = rec.get("step")
            if isinstance(step, int):
                self.step = max(self.step, step)
            v = objective_value(rec, objective)
            if v is not None and isinstance(step, int):
                out.append((step, v))
        return out

    def stop(self, reason: str | None = None) -> None:
        """Ask the trial to stop after its step (a checkpoint is written, as for any stopped run); if it
        has not ended after the grace, its group gets SIGTERM, and after twice the grace its whole tree
        SIGKILL (``escalate``): a step hung in C code ends too, and whatever it started."""
        if self.proc.poll() is None:
            write_control(self.run_dir, "stop", reason)
            if self._stop_at is None:
                self._stop_at = time.monotonic()

    def escalate(self, grace: float) -> None:
        if self._stop_at is None or self.proc.poll() is not None:
            return
        waited = time.monotonic() - self._stop_at
        if waited > 2 * grace:
            kill_tree(self.proc.pid, signal.SIGKILL)
        elif waited > grace and not self._terminated:
            self._terminated = True
            signal_group(self.proc.pid, signal.SIGTERM)

    def kill(self) -> None:
        """SIGTERM to the trial's whole group (the sweep exits at once: its guard finishes the job)."""
        if self.proc.poll() is None:
            signal_group(self.proc.pid, signal.SIGTERM)

    def status(self) -> dict[str, Any]:
        try:
            data = json.loads((self.run_dir / STATUS).read_text(encoding="utf-8"))
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def error_line(self) -> str:
        s = self.status()
        msg = s.get("message") or ""
        if not msg:
            try:
                lines = (self.run_dir / CONSOLE).read_text(errors="replace").strip().splitlines()
                msg = next((ln for ln in reversed(lines) if "error" in ln.lower()), lines[-1] if lines else "")
            except OSError:
                msg = ""
        return f"{s.get('state', 'exited')} (exit {self.proc.returncode}){': ' + msg if msg else ''}"[:300]


def run_trial(
    trial: Any, proc: TrialProcess, objective: str, should_stop: Any, timeout_s: float | None = None
) -> TrialOutcome:
    """Follow ``proc`` to its end: report each evaluation to ``trial``, prune when the pruner says so,
    stop when ``should_stop()`` turns true (the sweep is stopping) or after ``timeout_s`` seconds."""
    try:
        return _follow(trial, proc, objective, should_stop, timeout_s)
    finally:
        proc.guard.release()


def _follow(trial: Any, proc: TrialProcess, objective: str, should_stop: Any, timeout_s: float | None) -> TrialOutcome:
    last: float | None = None
    pruned_at: int | None = None
    stopping = timed_out = by_hand = False
    grace = grace_s()
    while True:
        done = proc.proc.poll() is not None
        for step, v in proc.new_values(objective):
            last = v
            if pruned_at is not None or stopping:
                continue
            if math.isfinite(v):
                trial.report(v, step)
            if not math.isfinite(v) or trial.should_prune():  # a diverged trial is pruned, whatever the pruner
                pruned_at = step
                why = f"{objective} is {v}" if not math.isfinite(v) else "its pruner"
                proc.stop(f"pruned by the sweep, {why}, at its evaluation of step {step}")
        if done:
            break
        if not stopping and should_stop():
            stopping = True
            proc.stop("the sweep was stopped")
        if not by_hand and (proc.run_dir / REQUEST).exists():  # stopped or pruned from the app: escalate too
            by_hand = True
            proc.stop()
        if timeout_s and not timed_out and time.time() - proc.started > timeout_s:
            timed_out = True
            proc.stop(f"timed out after {timeout_s:g} s (--trial-timeout)")
        proc.escalate(grace)
        time.sleep(POLL_S)
    return _outcome(trial, proc, objective, last, pruned_at, stopping, timed_out, timeout_s)


def _outcome(
    trial: Any,
    proc: TrialProcess,
    objective: str,
    last: float | None,
    pruned_at: int | None,
    stopping: bool,
    timed_out: bool,
    timeout_s: float | None,
) -> TrialOutcome:
    """How the trial ended, as its run folder says: a run that reached its end ("finished") is judged on
    its objective, whatever was asked of it too late (a prune decided at its last evaluation, a stop as
    it ended): the study and the folder always agree. A pruned trial's folder says it stopped, and why."""
    state = proc.status().get("state")
    rc = proc.proc.returncode
    if state == "finished" and rc == 0:
        if pruned_at is not None:  # the pruner's word came after the run's end: it stands complete
            trial.set_user_attr("pruned_too_late_at_step", pruned_at)
        if last is None:
            return TrialOutcome("failed", None, f"the run logged no {objective!r}")
        if not math.isfinite(last):
            return TrialOutcome("failed", last, f"{objective} is {last}")
        return TrialOutcome("complete", last)
    asked = requested(proc.run_dir)
    if (pruned_at is not None or asked == "prune") and state != "failed":  # a crash says so, not "pruned"
        if pruned_at is not None:
            trial.set_user_attr("pruned_at_step", pruned_at)
        return TrialOutcome("pruned", last)
    if asked == "stop":
        return TrialOutcome("failed", last, "stopped by hand")
    if timed_out:
        return TrialOutcome("failed", last, f"timed out after {timeout_s:g} s (--trial-timeout)")
    if stopping:
        return TrialOutcome("interrupted", last, "the sweep was stopped")
    if rc is not None and rc < 0 and state not in TERMINAL_STATES:  # killed with no end: lost, not failed
        return TrialOutcome("lost", last, f"its process was killed ({_signal_name(-rc)}) before it recorded an end")
    return TrialOutcome("failed", last, proc.error_line())


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
