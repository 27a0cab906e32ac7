"""What a strategy offers the loop (``Strategy``), and the single-process one: the run's devices as lanes
of one process (``Lanes``), each step's forward, backward and reduction by ``engine/parallel``'s
replicate or persistent lanes.

The loop (trainer.py) is written once; it calls its strategy at named points and never asks which one
runs. The other strategies, one process per device, are ddp and fsdp (engine/distributed/).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from multilane.engine.data.loader import build_loader
from multilane.engine.parallel import chunk_sizes, make_backend, make_strategy
from multilane.engine.parallel.replicas.sync_batchnorm import convert_sync_batchnorm
from multilane.engine.run import checkpointer
from multilane.engine.run.evaluation import evaluate_run
from multilane.engine.run.metrics_window import MetricsWindow
from multilane.engine.run.run_spec import open_run_dir, planned_steps
from multilane.engine.rundir.runlog import RunDir
from multilane.engine.tasks import loss_weight_fn
from multilane.engine.telemetry.memory_split import lanes_memory
from multilane.engine.telemetry.sampler import TelemetrySampler, run_sampler
from multilane.engine.tensors import features
from multilane.engine.tensors.optim import build_optimizer

if TYPE_CHECKING:
    from multilane.engine.health.nan_origin import StepReplay
    from multilane.engine.health.tracer import Tracer
    from multilane.engine.run.trainer import Trainer


class Strategy(Protocol):
    """How a run is spread over its devices: what differs between strategies, each method called by the
    loop ``t`` at its named point (the ddp and fsdp strategies: engine/distributed/ddp.py, fsdp_rank.py)."""

    sharded: bool  # the model's state sharded: checkpoints load through the sharded state-dict helpers
    place: Any  # a rank's (device, rank, world), which its memory meter measures; None: one process's lanes
    settling: bool  # its first steps differ from the rest (ddp: the reach probe): the fit probe measures after them

    def open_resume_dir(self, path: str | Path) -> RunDir: ...  # locked by the process that writes it
    def open_run_dir(self, t: Trainer) -> RunDir: ...  # the resumed one, the one given, or a new one

    def setup(self, t: Trainer) -> None:
        """The loader, the model and optimizer on the strategy's devices, the log window."""

    def health_spread(self, t: Trainer) -> dict[str, Any]:
        """Health's view of the devices (``make_monitor``'s ``lanes``, ``device``, ``exchange``, ``sharded``)."""

    def attach(self, t: Trainer) -> None:
        """After the loop built ``t.health``: health handed where the gradients come from, the checkpoint
        restored (the loop then starts the loader at the run's next micro-batch)."""

    def lane_names(self, t: Trainer) -> list[str]: ...  # the names the per-device series go by
    def sizes(self, t: Trainer, batch: int) -> list[int]: ...  # each device's share of a batch
    def train_step(self, t: Trainer, accum: int) -> None: ...  # forward, backward, reduction (t.optimizer_step)
    def sync_control(self, t: Trainer) -> None: ...  # between steps: pause and stop, every process agreeing
    def wait_paused(self, t: Trainer) -> None: ...
    def checkpoint_due(self, t: Trainer) -> bool: ...  # the checkpoint cadence's wall time has come
    def log(self, t: Trainer, **extra: Any) -> None: ...  # the open log window's record (t.publish)
    def stop(self, t: Trainer) -> None: ...  # a stop between log points: the checkpoint and the window's record
    def state_finite(self, t: Trainer) -> bool: ...  # what a checkpoint would hold is finite, on every process
    def evaluate(self, t: Trainer) -> None: ...  # the eval record at t.step (t.publish_eval)
    def memory(self, t: Trainer) -> dict[str, Any]: ...  # each device's split of its memory, for the record
    def make_sampler(self, t: Trainer) -> TelemetrySampler | None: ...
    def checkpoint_state(self, t: Trainer) -> dict[str, Any]: ...
    def finish(self, t: Trainer, status: str) -> None: ...  # before the run's end is recorded
    def replay(self, t: Trainer) -> StepReplay: ...  # the loop's side of a NaN's replay (engine/health/nan_origin.py)


class Lanes:
    """One process, its devices as lanes (``engine/parallel``: replicate each step, or persistent replicas)."""

    sharded = False
    place = None
    settling = False

    def open_resume_dir(self, path: str | Path) -> RunDir:
        return RunDir.open_existing(path)  # locked: this process is its one writer

    def open_run_dir(self, t: Trainer) -> RunDir:
        return open_run_dir(t._resume_dir, t._made_run_dir, t.config)

    def setup(self, t: Trainer) -> None:
        cfg = t.config
        torch.manual_seed(cfg.train.seed)
        t.backend = make_backend(t.devices, cfg.devices.output)
        t.strategy = make_strategy(cfg.devices.strategy, t.backend, cfg.train.precision, cfg.train.seed)
        t._loss_weight = loss_weight_fn(t.task)
        dev = t.backend.model_device
        t._phase("loading data")
        t.loader = build_loader(t.task, cfg, dev if dev.type == "cuda" else None)
        if t.memory is not None:
            t.memory.before_model()
        t._phase("building the model")
        t.model = t.task.build_model().to(dev)
        features.check_model(t.model, cfg)  # before step 1 (a model the meta device could not build)
        if cfg.devices.sync_batchnorm:
            convert_sync_batchnorm(t.model)
        t.optimizer = build_optimizer(t.model.parameters(), cfg.optim)
        t.total_steps = planned_steps(t.task, cfg, t.loader.per_epoch)
        t.scaler = torch.amp.GradScaler(t.backend.device_type, enabled=cfg.train.precision == "fp16")
        self._sizes_cache: dict[int, list[int]] = {}
        self._copies = hasattr(t.strategy, "replicas") and len(t.devices) > 1  # persistent's own replicas
        self._weights = cfg.devices.weights or None
        t.timer = t.backend.make_timer()
        t.window = MetricsWindow(t.backend.lane_names)

    def health_spread(self, t: Trainer) -> dict[str, Any]:
        return {"lanes": len(t.devices), "device": t.backend.output_device}

    def attach(self, t: Trainer) -> None:
        t.strategy.lane_grads = t.health.probe
        if t._checkpoint is not None:
            t._phase("restoring the checkpoint")
            checkpointer.restore(t, t._checkpoint)

    def lane_names(self, t: Trainer) -> list[str]:
        return list(t.backend.lane_names)

    def sizes(self, t: Trainer, batch: int) -> list[int]:
        s = self._sizes_cache.get(batch)
        if s is None:
            s = self._sizes_cache[batch] = chunk_sizes(batch, len(t.devices), self._weights)
        return s

    def replicas(self, t: Trainer) -> list[torch.nn.Module] | None:
        """The strategy's own copies of the model (persistent; None until it has made them), or []."""
        return (t.strategy.replicas() or None) if self._copies else []

    def train_step(self, t: Trainer, accum: int) -> None:
        timer, window, strategy, health = t.timer, t.window, t.strategy, t.health
        fp16 = t.scaler if t.scaler.is_enabled() else None
        step = t.step + 1
        t.set_lr()
        if step not in health.idle:
            health.begin_step(step, t.model, accum, self.replicas(t))
        for k in range(accum):
            timer.mark_host("data")
            inputs, target, size = t.loader.next()
            sizes = self.sizes(t, size)
            zero = t.optimizer if k == 0 else None  # the last step's gradients, freed before this backward
            out = strategy.train_micro(
                t.model, inputs, target, t.task.loss, sizes, timer, t._loss_weight, zero, accum, fp16
            )
            if health.on:
                health.micro(out.lane_weights or [sizes[i] for i in out.lanes], out.lanes, accum)
            window.add(out, size, step)
        strategy.reduce_gradients(timer)
        t.optimizer_step()
        strategy.sync_replicas(t.model, timer)
        timer.end_step()
        window.end_step()

    def sync_control(self, t: Trainer) -> None:
        t._control_file.apply(t.control)  # cheap: see control_file.py

    def wait_paused(self, t: Trainer) -> None:
        """A pause, resume or stop can also come through the control file."""
        while not t.control.wait_while_paused(0.2):
            t._control_file.apply(t.control)

    def checkpoint_due(self, t: Trainer) -> bool:
        return checkpointer.due(t)

    def log(self, t: Trainer, **extra: Any) -> None:
        first, samples = t.window.first_step or t.step, t.window.samples
        rec = t.window.record(**t.record_head(), **extra)
        if rec is None:
            return
        rec["phase_ms"] = t.timer.read()
        busy = t.backend.lane_busy_seconds()
        if busy is not None:
            rec["lane_busy_s"] = dict(zip(t.backend.lane_names, busy, strict=True))
        rec.update(t.energy.at_log(samples))
        t.publish(rec, first)

    def stop(self, t: Trainer) -> None:
        """Save the checkpoint (which carries the open log window, so a resume logs exactly what an
        uninterrupted run would), then report that window as a partial record, superseded by the
        resumed run's own record if the run is resumed."""
        checkpointer.save_finite(t)
        t._log(partial=True)

    def state_finite(self, t: Trainer) -> bool:
        return bool(checkpointer.finite_flag(t, t.backend.output_device).item())  # one read

    def evaluate(self, t: Trainer) -> None:
        evaluate_run(t)

    def memory(self, t: Trainer) -> dict[str, Any]:
        return lanes_memory(t.model, t.optimizer, t.strategy, t.backend)

    def make_sampler(self, t: Trainer) -> TelemetrySampler | None:
        return run_sampler(t.config, t.devices, t.backend, lambda r: t.dispatch({**r, "step": t.step}))

    def checkpoint_state(self, t: Trainer) -> dict[str, Any]:
        return checkpointer.checkpoint_state(t)

    def finish(self, t: Trainer, status: str) -> None:
        pass

    def replay(self, t: Trainer) -> StepReplay:
        return LanesReplay(t, self)


class LanesReplay:
    """The loop's side of a NaN's replay on one process's lanes (``StepReplay``): its state, and its own
    step run again; a rank strategy's (engine/distributed/ddp.py) changes the streams, loader and window."""

    def __init__(self, t: Trainer, spread: Any) -> None:
        self.t, self.spread, self.task = t, spread, t.task
        self.accum, self.lanes = t.config.train.grad_accum, len(t.devices)

    lane_names = property(lambda self: self.t.lane_names)
    model = property(lambda self: self.t.model)
    optimizer = property(lambda self: self.t.optimizer)
    scaler = property(lambda self: self.t.scaler)
    step = property(lambda self: self.t.step, lambda self, v: setattr(self.t, "step", v))

    def gather(self, obj: Any) -> list[Any]:
        return [obj]  # one process: its lanes are the run's

    def lane_rng(self) -> Any:
        random = getattr(self.t.strategy, "random", None)
        return random.state_dict() if random is not None else None

    def set_lane_rng(self, state: Any) -> None:
        self.t.strategy.random.load_state_dict(state)

    def replicas(self) -> list[torch.nn.Module]:
        return self.spread.replicas(self.t) or []

    def sizes(self, batch: int) -> list[int]:
        return self.spread.sizes(self.t, batch)

    def loader(self) -> Any:
        dev = self.t.backend.model_device
        return build_loader(self.t.task, self.t.config, dev if dev.type == "cuda" else None)

    @contextlib.contextmanager
    def replaying(self, loader: Any) -> Iterator[None]:
        t = self.t
        saved, t.loader, t.health.muted = (t.loader, t.window), loader, True  # a replayed step is not the run's
        try:
            yield
        finally:
            (t.loader, t.window), t.health.muted = saved, False

    def run_step(self, step: int, tracer: Tracer) -> Any:
        t, strategy = self.t, self.t.strategy
        t.window = MetricsWindow(self.lane_names)
        t.window.resume()
        grads, strategy.lane_grads = strategy.lane_grads, tracer  # replicate shows it each lane's own copies
        try:
            t.spread.train_step(t, self.accum)
        finally:
            strategy.lane_grads = grads
        t.step = step
        return t.window.record(step=step)

    def record(self, windows: list[Any], step: int) -> dict[str, Any] | None:
        return windows[0]
