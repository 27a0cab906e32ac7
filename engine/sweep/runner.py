"""The sweep loop: one thread per slot, each asking the study for a trial, running it (trial_run.py) and
telling the study how it ended, the next trial starting as soon as its slot frees, until the study
holds the asked number of finished trials (complete, pruned or failed on their own; a trial lost to a
kill or a stop is re-queued and does not count)."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any

from multilane.engine.errors import UserError
from multilane.engine.start.server import start_way
from multilane.engine.sweep.optuna_lib import optuna
from multilane.engine.sweep.study import Sweep
from multilane.engine.sweep.trial_run import TRIAL_START_ENV, TrialProcess, run_trial, trial_config


@dataclass
class Live:
    """What the live table shows of a trial this process runs: its step and its run folder."""

    process: TrialProcess
    devices: str


@dataclass
class SweepRunner:
    """Runs ``sweep``'s trials on ``slots`` (a devices string each) until ``target`` trials are done."""

    sweep: Sweep
    slots: list[str]
    target: int
    live: dict[int, Live] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    worker: str | None = None  # the name its trials record as their host (sweep-worker --worker-name)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()  # one thread talks to the storage at a time
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        cpu = all(s.startswith("cpu") for s in self.slots)
        self._threads_per_trial = max(1, (os.cpu_count() or 1) // len(self.slots)) if cpu else None

    # -- control --------------------------------------------------------------------------------------
    def start(self) -> None:
        start_way(TRIAL_START_ENV)  # a wrong MULTILANE_TRIAL_START is one line before any trial starts
        with self._lock:
            self.sweep.recover_lost()
        for i, devices in enumerate(self.slots):
            t = threading.Thread(target=self._slot, args=(devices,), name=f"sweep-slot-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        """Stop the sweep: running trials stop with a checkpoint and are re-queued for a resume."""
        self._stop.set()

    def hurry(self) -> None:
        """This process exits now (a second Ctrl+C): each running trial's guard ends its whole tree
        after a short grace instead of the whole one."""
        for live in list(self.live.values()):
            live.process.guard.hurry()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """True when every slot has finished."""
        for t in self._threads:
            t.join(timeout)
        return not self.running()

    def running(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    # -- one slot -------------------------------------------------------------------------------------
    def _slot(self, devices: str) -> None:
        while not self._stop.is_set():
            try:
                with self._lock:
                    asked = self.sweep.ask(self.worker, self.target)  # None: the target is reached
                    if asked is None:
                        return
                    trial, params = asked
                    try:
                        proc = self._begin(trial, params, devices)
                    except Exception as e:  # the trial never ran: not left "running", its params re-queued
                        self.sweep.fail_and_requeue(trial, f"could not start it: {str(e).splitlines()[0][:200]}")
                        raise
                if proc is not None:
                    self._run(trial, proc, devices)
            except UserError as e:
                self.errors.append(str(e))
                self._stop.set()
                return
            except Exception as e:  # the storage went away: the sweep stops, trials are recovered on resume
                self.errors.append(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                self._stop.set()
                return

    def _begin(self, trial: Any, params: dict[str, Any], devices: str) -> TrialProcess | None:
        """The asked trial's run folder and process; None when its config is refused."""
        folder = self.sweep.folder / f"trial-{trial.number:04d}"
        for i in range(2, 1000):  # a worker's folder may hold an earlier study's trials of the same name
            if not folder.exists():
                break
            folder = self.sweep.folder / f"trial-{trial.number:04d}-{i}"
        trial.set_user_attr("run_dir", str(folder))
        trial.set_user_attr("devices", devices)
        spec = self.sweep.spec
        try:
            config = trial_config(spec.base, params, spec.task, devices, self.sweep.folder, trial.number)
        except UserError as e:  # a combination the config refuses (sgd nesterov with momentum 0)
            trial.set_user_attr("error", str(e))
            self.sweep.study.tell(trial, state=optuna().trial.TrialState.FAIL)
            return None
        return TrialProcess(config, folder, self._threads_per_trial)

    def _run(self, trial: Any, proc: TrialProcess, devices: str) -> None:
        self.live[trial.number] = Live(proc, devices)
        with self._lock:
            trial.set_user_attr("trial_pid", proc.proc.pid)  # its process group's too (its own session)
        ts = optuna().trial.TrialState
        lock = self._lock

        class Locked:  # the trial's report/should_prune go through the storage lock too
            def report(self, value: float, step: int) -> None:
                with lock:
                    trial.report(value, step)

            def should_prune(self) -> bool:
                with lock:
                    return trial.should_prune()

            def set_user_attr(self, key: str, value: Any) -> None:
                with lock:
                    trial.set_user_attr(key, value)

        timeout = self.sweep.spec.trial_timeout
        outcome = run_trial(Locked(), proc, self.sweep.spec.objective, self._stop.is_set, timeout)
        with self._lock:
            trial.set_user_attr("last_step", proc.step)
            if outcome.state == "complete":
                self.sweep.study.tell(trial, outcome.value)
            elif outcome.state == "pruned":
                self.sweep.study.tell(trial, state=ts.PRUNED)
            elif outcome.state == "interrupted":
                self.sweep.fail_and_requeue(trial, outcome.message or "interrupted")
            elif outcome.state == "lost":  # killed (kill -9, out of memory): re-queued, not counted
                self.sweep.fail_and_requeue(trial, outcome.message or "lost", killed=True)
            else:
                trial.set_user_attr("error", outcome.message or "failed")
                self.sweep.study.tell(trial, state=ts.FAIL)
                if outcome.message and "logged no" in outcome.message:
                    self.errors.append(
                        f"--objective {self.sweep.spec.objective}: trial {trial.number} {outcome.message}; "
                        "name a metric the task logs (val_loss, loss, or one of its metrics)"
                    )
                    self._stop.set()
        del self.live[trial.number]
