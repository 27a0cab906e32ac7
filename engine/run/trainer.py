"""The training loop, written once for every strategy: a short loop over parts with one job each.

What differs between strategies (set-up, a step's forward, backward and reduction, the ranks' agreement
on pause and stop, the log window's and evaluation's reduction, a checkpoint's state) is the strategy's
(``lanes.py``: ``Strategy``; one process's lanes there, ddp and fsdp in engine/distributed/). The run's
config and task (``run_spec.py``), the log window (``metrics_window.py``), checkpoints (``checkpointer.py``),
the run folder (``runlog.py``) and the run's end (``run_end.py``) each live in their own module; the
trainer composes them and reports only through plain callbacks (``callbacks.py``, no Qt).
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from multilane.engine.config import RunConfig
from multilane.engine.errors import UserError, nothing_to_train
from multilane.engine.health.run_health import RunHealth, make_monitor
from multilane.engine.plan.fit import check_fit
from multilane.engine.plan.meter import NO_METER as _NO_METER
from multilane.engine.plan.meter import run_meter
from multilane.engine.run import checkpointer
from multilane.engine.run.callbacks import MetricsWriter, RunResult, TrainerCallback
from multilane.engine.run.control import RunControl
from multilane.engine.run.energy import EnergyMeter
from multilane.engine.run.failures import outcome, release_cuda_memory
from multilane.engine.run.lanes import Lanes, Strategy
from multilane.engine.run.metrics_window import NonFiniteLoss, check_finite
from multilane.engine.run.run_end import finish_run, fit_check_phases, setup_begins, setup_ended, training_begins
from multilane.engine.run.run_spec import record_run, resolve_run
from multilane.engine.rundir.control_file import ControlFile
from multilane.engine.rundir.follow import DIVERGED
from multilane.engine.rundir.runlog import RunDir
from multilane.engine.rundir.writefile import check_writable
from multilane.engine.tasks import Task, add_token_fields
from multilane.engine.telemetry.devices import Device
from multilane.engine.telemetry.sampler import TelemetrySampler
from multilane.engine.tensors import features
from multilane.engine.tensors.grads import clip_grad_norm, grad_norm
from multilane.engine.tensors.optim import lr_at

__all__ = ["NonFiniteLoss", "RunResult", "Trainer", "TrainerCallback"]


class Trainer:
    """Train ``config`` (or resume the run in ``resume_from``), reporting to ``callbacks``.

    Bad input raises ``UserError`` from the constructor, before any folder is written; ``run()`` makes
    the folder ("starting", with its set-up's phase) before any of the task's code runs. A failure
    during the run does not raise: ``run()`` returns a result with status "failed" and the message,
    and the run directory keeps the traceback and every metric logged so far.
    """

    def __init__(
        self,
        config: RunConfig | None = None,
        callbacks: Sequence[TrainerCallback] = (),
        control: RunControl | None = None,
        resume_from: str | Path | None = None,
        overrides: dict[str, Any] | None = None,
        task: Task | None = None,
        run_dir: str | Path | None = None,
        strategy: Strategy | None = None,
    ) -> None:
        self.spread: Strategy = strategy if strategy is not None else Lanes()  # how the run is spread
        self.control = control or RunControl()
        self._made_run_dir = Path(run_dir) if run_dir else None  # made for this run by whoever started it
        self.callbacks = list(callbacks)
        self._checkpoint: dict[str, Any] | None = None
        self._resume_dir: RunDir | None = None
        self.checkpoint_step: int | None = None  # the step of the checkpoint on disk, if any
        self.run_dir: RunDir | None = None
        self.sampler: TelemetrySampler | None = None
        self.step = 0
        self.memory: Any = None
        if resume_from is not None:
            self._resume_dir = self.spread.open_resume_dir(resume_from)
        try:
            self._configure(config, overrides or {}, task)
            if self._resume_dir is None and self._made_run_dir is None:
                # now, not after set-up (data, model: seconds to minutes), which RunDir.create follows
                check_writable(Path(self.config.run.runs_dir).expanduser(), create=False)
        except BaseException:
            if self._resume_dir is not None:
                self._resume_dir.close_refused()
            raise

    @classmethod
    def for_probe(
        cls, config: RunConfig, task: Task, devices: list[Device], strategy: Strategy | None = None
    ) -> Trainer:
        """A loop of ``config`` (on the lanes, or ``strategy``'s) with no run folder, callbacks or checkpoint: the fit
        probe (engine/plan/probe.py) drives its strategy's own set-up and step, and its ``optimizer_step``."""
        t = cls.__new__(cls)
        t.spread = strategy if strategy is not None else Lanes()
        t.config, t.task, t.devices, t.callbacks = config, task, devices, []
        t.run_dir, t._checkpoint, t.step, t.memory = None, None, 0, None
        return t

    def _configure(self, config: RunConfig | None, overrides: dict[str, Any], task: Task | None) -> None:
        spec = resolve_run(config, overrides, task, self._resume_dir, self.callbacks)
        self._checkpoint, self.config, self.task = spec.checkpoint, spec.config, spec.task
        self.checkpoint_step = spec.checkpoint["step"] if spec.checkpoint is not None else None
        self.task_file = spec.task_file  # {"path", "sha256"} of a task file, else None
        self.devices: list[Device] = spec.devices

    # -- setup ----------------------------------------------------------------------------------
    def _setup(self) -> None:
        """The strategy sets up the run's parts; the loader's workers start here, before the telemetry
        thread, at the run's next micro-batch."""
        cfg = self.config
        self.memory = run_meter(
            self.devices, getattr(self, "forecast", None), self.spread.place, cfg.devices.weights or None
        )
        self.setup_parts()
        accum = cfg.train.grad_accum
        self._phase("starting the data loader")
        self.loader.start(self.step * accum, self.total_steps * accum)

    def setup_parts(self) -> None:
        """What a step needs, built: the strategy's set-up. The fit probe (engine/plan/probe.py) builds the
        same before it drives the strategy's step, so what the loop adds here the probe measures too."""
        self.spread.setup(self)
        # Health, once for every strategy, before the checkpoint (which holds its noise-scale average)
        # is restored; the strategy then hands it its gradients (``Strategy.attach``).
        cfg = self.config
        weighted = self._loss_weight is not None
        self.health = make_monitor(cfg.health, self.task, weighted, **self.spread.health_spread(self))
        replay = self.spread.replay(self) if cfg.health.enabled and cfg.health.nan_replay else None
        self.run_health = RunHealth(self.health, replay, self._event, self.callbacks)
        self.spread.attach(self)

    def _sizes(self, batch: int) -> list[int]:
        return self.spread.sizes(self, batch)

    # -- the loop -------------------------------------------------------------------------------
    def run(self) -> RunResult:
        """Set up, train, and record how the run ended — whatever ended it (an error, the task's own
        ``sys.exit``, a second Ctrl+C, a full disk): status.json and the last event say so."""
        try:
            return self._run()
        except BaseException:
            if self.run_dir is None and self._resume_dir is not None:  # refused at set-up: as it was found
                self._resume_dir.close_refused()
            raise
        finally:
            for rd in (self.run_dir, self._resume_dir):
                if rd is not None:
                    rd.close()  # the lock goes on every way out (a no-op after _finish)

    def _run(self) -> RunResult:
        cfg = self.config
        if cfg.train.tensorboard:  # before anything is written: a missing extra is one line
            from multilane.integrations.extras import MissingExtra

            try:
                from multilane.integrations.tensorboard import TensorBoardWriter
            except MissingExtra as e:
                raise UserError(str(e)) from None
        from multilane.integrations.mlflow_records import mlflow_callback

        mlflow_logger = mlflow_callback(cfg)  # a missing mlflow extra: one line, before anything is written
        # The folder first, before any of the task's code runs: watch, control and the app see the run
        # "starting" and its phase, and a stop reaches it there (run_end.setup_begins, RunControl.during_setup).
        self.run_dir = rd = self.spread.open_run_dir(self)
        self._control_file = ControlFile(rd.path)
        self.t_start = time.time()
        self._at_step = self.step  # the step a failure is reported at
        self._last_train: dict[str, Any] = {}
        self._last_eval: dict[str, Any] = {}
        resumed = self._checkpoint is not None
        before = setup_begins(self, rd, record=lambda: record_run(rd, cfg, self.task_file))
        try:
            with self.control.during_setup(lambda: self._control_file.apply(self.control)):
                with fit_check_phases(self):  # both build the task's model: the phase says so
                    features.check(cfg, self.task)  # a feature the strategy cannot train: one line (engine/tensors/)
                    self.forecast = check_fit(
                        cfg, self.task, self.devices, Trainer.for_probe
                    )  # before anything starts (engine/plan/)
                self._setup()
                if self._checkpoint is not None and self.step >= self.total_steps:  # an epoch budget, known now
                    raise nothing_to_train(getattr(self._resume_dir, "path", ""), self.step, self.total_steps)
        except BaseException as e:  # stopped, refused, crashed: the folder says so (or is as it was found)
            return setup_ended(self, e, before)
        self.checkpoint_time = time.monotonic()
        self.energy = EnergyMeter(None)
        self._epoch = self.loader.epoch_at(self.step * cfg.train.grad_accum)
        status, message, tb = "finished", None, None
        try:
            rd.reserve_space()  # freed to record a failure if the disk fills up
            record_run(rd, cfg, self.task_file)  # again: a resume's config (its overrides) once it set up
            self.callbacks.insert(0, MetricsWriter(rd))
            if cfg.train.tensorboard and rd.writes:
                self.callbacks.insert(1, TensorBoardWriter(rd.path))
            if mlflow_logger is not None and rd.writes:  # under ddp/fsdp one rank logs: the one writing the folder
                self.callbacks.append(mlflow_logger(rd.path))
            training_begins(self, rd, resumed)
            status, message = self._loop()
        except BaseException as e:  # KeyboardInterrupt and SystemExit too: never recorded as "finished"
            status, message = outcome(e, self.task.name, self._at_step, rd.path, self.checkpoint_step)
            tb = None if isinstance(e, KeyboardInterrupt) else traceback.format_exc()
            if isinstance(e, torch.OutOfMemoryError):
                release_cuda_memory()
        return self._finish(status, message, tb)

    @property
    def lane_names(self) -> list[str]:
        """The names the run's per-device series go by (``device_loss`` keys)."""
        return self.spread.lane_names(self)

    def _loop(self) -> tuple[str, str | None]:
        """Train to the end or a stop; a non-finite loss or weights end the run "diverged", nothing saved
        after them (``checkpointer.save_finite``): the last checkpoint stays the last good state."""
        try:
            return self._steps()
        except NonFiniteLoss as e:
            message = checkpointer.diverged_message(self, e)
            if self.config.train.on_nonfinite == "pause":
                self._pause(message)
            return DIVERGED, message

    def _steps(self) -> tuple[str, str | None]:
        cfg = self.config
        log_every, eval_every = cfg.train.log_every, cfg.train.eval_every
        ckpt_every, accum = cfg.train.checkpoint_every, cfg.train.grad_accum
        self.window.resume()  # the window's clock runs from here (also a window a checkpoint restored)
        memory = getattr(self, "memory", None) or _NO_METER
        memory.start(self.total_steps, self.step, log_every)
        while self.step < self.total_steps:
            self.spread.sync_control(self)
            self.control.wait_while_held()
            if self.control.pause_requested and not self.control.stop_requested:
                self._pause()
            if self.control.stop_requested:
                self.spread.stop(self)
                why = self.control.stop_reason
                return "stopped", f"stopped at step {self.step}" + (f" ({why})" if why else "")
            self._at_step = self.step + 1
            self.run_health.before_step(self.step, self.window)  # the state a replay of this window starts from
            with memory.step(self.step + 1, getattr(self, "backend", None)):  # a ddp rank has none
                self.spread.train_step(self, accum)
            self.step += 1
            self._at_step = self.step
            epoch = self.loader.epoch_at(self.step * accum)
            if epoch > self._epoch:
                self._epoch_end(epoch)
            last = self.step == self.total_steps
            if self._logs_at(self.step):
                self._log(memory=self.spread.memory(self))
            if (eval_every and self.step % eval_every == 0) or last:
                self.spread.evaluate(self)
            if (ckpt_every and self.step % ckpt_every == 0) or last or self.spread.checkpoint_due(self):
                checkpointer.save_finite(self)
        return "finished", None

    def _state_finite(self) -> bool:
        """Whether the state a checkpoint would hold is finite (``checkpointer.finite_flag``; every rank's)."""
        return self.spread.state_finite(self)

    def _phase(self, what: str) -> None:
        """The set-up's phase, in the run folder's status ("starting": loading data, building the model)."""
        self.phase = what
        if self.run_dir is not None:
            self.run_dir.set_status("starting", what, phase=what, step=self.step)

    def _logs_at(self, step: int) -> bool:
        """Whether ``step`` ends a log window (``train.log_every``, or the run's last step)."""
        return step % self.config.train.log_every == 0 or step == self.total_steps

    def set_lr(self) -> None:
        """The learning rate of the step about to be taken (a pure function of the step: ``lr_at``)."""
        cfg = self.config
        lr = lr_at(self.step, self.total_steps, cfg.optim.lr, cfg.schedule)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def optimizer_step(self) -> None:
        """After the strategy's reduction, on every strategy: health reads the gradients, clipping (or the
        norm of the step that logs), the update."""
        opt, scaler, window, health, model = self.optimizer, self.scaler, self.window, self.health, self.model
        fp16 = scaler.is_enabled()
        measured = health.on  # a sampled or measured step (most are neither: no calls)
        if measured:
            health.after_reduce(model, scaler._scale if fp16 else None)
        self.timer.mark("optimizer")
        clip = self.config.train.grad_clip
        if clip > 0:
            scaler.unscale_(opt)
            window.add_grad_norm(clip_grad_norm(model.parameters(), clip))
        elif self._logs_at(self.step + 1):  # not clipping: the norm of the step that logs (each step's cost 6 %)
            scaler.unscale_(opt)
            window.add_grad_norm(grad_norm(model.parameters()))
        if measured:
            health.before_update()
        if fp16:
            scaler.step(opt)
            scaler.update()
        else:  # what GradScaler does when disabled, without its two calls
            opt.step()
        if measured:
            health.after_update()

    def _log(self, **extra: Any) -> None:
        """Report the open log window as a train record (nothing if it is empty)."""
        self.spread.log(self, **extra)

    def record_head(self) -> dict[str, Any]:
        """The fields a train record of this step begins with."""
        epoch = self.loader.epoch_fraction(self.step * self.config.train.grad_accum)
        return {"step": self.step, "epoch": epoch, "wall_time": time.time(), "lr": self.optimizer.param_groups[0]["lr"]}

    def publish(self, rec: dict[str, Any], first: int, others: Sequence[dict[str, Any]] = ()) -> None:
        """A log window's record: health's part of it, then (``others``: other ranks' telemetry) to the
        callbacks; a non-finite loss in it ends the run (``NonFiniteLoss``, from step ``first``)."""
        add_token_fields(self.task, rec)  # a language model's tokens_per_s
        self.run_health.report(rec)  # every rank: its noise-scale read is a collective
        for r in others:
            self.dispatch(r)
        self._last_train = rec
        for cb in self.callbacks:
            cb.on_log(rec)
        check_finite(rec, first, self.step)

    def publish_eval(self, rec: dict[str, Any]) -> None:
        self._last_eval = rec
        for cb in self.callbacks:
            cb.on_eval(rec)

    def _epoch_end(self, epoch: int) -> None:
        """Mark an epoch's end; where the GPUs report power, with the energy it took."""
        energy = self.energy.at_epoch((epoch - self._epoch) * (self.loader.n or 0))
        self._epoch = epoch
        self._event("epoch_end", epoch=epoch, **energy)

    def _pause(self, reason: str | None = None) -> None:
        if reason:
            self.control.pause()
        assert self.run_dir is not None
        self.run_dir.set_status("paused", reason, step=self.step, total_steps=self.total_steps)
        self._event("paused", **({"message": reason} if reason else {}))
        self.window.pause()  # paused time is not training time
        self.spread.wait_paused(self)
        self.window.resume()
        if not self.control.stop_requested:
            self.run_dir.set_status("running", step=self.step, total_steps=self.total_steps)
            self._event("resumed")

    def _event(self, name: str, **extra: Any) -> None:
        rec = {"kind": "event", "event": name, "step": self.step, "wall_time": time.time(), **extra}
        for cb in self.callbacks:
            cb.on_event(rec)

    def checkpoint_state(self) -> dict[str, Any]:
        """What a checkpoint holds; loadable with ``torch.load(path, weights_only=True)``."""
        return self.spread.checkpoint_state(self)

    def _make_sampler(self) -> TelemetrySampler | None:
        return self.spread.make_sampler(self)

    def dispatch(self, record: dict[str, Any]) -> None:
        """A telemetry record or an event (a rank's, or the sampler's) to the callbacks."""
        for cb in self.callbacks:
            if record["kind"] == "telemetry":
                cb.on_telemetry(record)
            else:
                cb.on_event(record)

    def _finish(self, status: str, message: str | None, tb: str | None) -> RunResult:
        self.spread.finish(self, status)
        return finish_run(self, status, message, tb)
