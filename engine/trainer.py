"""The training loop: data-parallel steps, evaluation, logging, checkpoints, pause/stop/resume.

It reports only through plain callbacks (no Qt): the run directory writer, the CLI's progress
display and the app's worker are all ``TrainerCallback``s.
"""

from __future__ import annotations

import contextlib
import math
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from multilane.engine import __version__
from multilane.engine.balance import balance_warnings
from multilane.engine.config import RunConfig, build_config, merge
from multilane.engine.control import RunControl
from multilane.engine.devices import Device, parse_devices
from multilane.engine.envinfo import environment
from multilane.engine.errors import UserError
from multilane.engine.loader import build_loader
from multilane.engine.optim import build_optimizer, lr_at
from multilane.engine.parallel import ReplicateEachStep, chunk_sizes, make_backend
from multilane.engine.parallel.tree import move_tree
from multilane.engine.runlog import CONFIG, ENVIRONMENT, SAMPLES, RunDir
from multilane.engine.tasks import Task, make_task
from multilane.engine.telemetry import TelemetrySampler


class TrainerCallback:
    """Hooks the trainer calls, named after the points they mark. Override what you need.

    Records are plain dicts (the same ones written to metrics.jsonl). Hooks run in the training
    thread: keep them short, and never touch a widget from them.
    """

    def on_train_start(self, trainer: Trainer) -> None: ...

    def on_log(self, record: dict[str, Any]) -> None:
        """Train metrics, every ``log_every`` steps."""

    def on_eval(self, record: dict[str, Any]) -> None:
        """Validation loss and the task's metrics."""

    def on_event(self, record: dict[str, Any]) -> None:
        """Lifecycle: started, paused, resumed, stopped, finished, failed; and warnings."""

    def on_telemetry(self, record: dict[str, Any]) -> None:
        """Device readings, from the sampler's own thread (not the training thread)."""

    def on_train_end(self, result: RunResult) -> None: ...


@dataclass
class RunResult:
    status: str  # finished | stopped | failed
    step: int
    run_dir: Path
    message: str | None = None
    traceback: str | None = None
    last_train: dict[str, Any] = field(default_factory=dict)
    last_eval: dict[str, Any] = field(default_factory=dict)
    elapsed_s: float = 0.0


class NonFiniteLoss(RuntimeError):
    pass


class _MetricsWriter(TrainerCallback):
    def __init__(self, run_dir: RunDir) -> None:
        self.run_dir = run_dir

    def on_log(self, record: dict[str, Any]) -> None:
        self.run_dir.append_metric(record)

    on_eval = on_log
    on_event = on_log
    on_telemetry = on_log


class Trainer:
    """Train ``config`` (or resume the run in ``resume_from``), reporting to ``callbacks``.

    Bad input raises ``UserError`` from the constructor, before any folder is written. A failure
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
    ) -> None:
        self.control = control or RunControl()
        self._checkpoint: dict[str, Any] | None = None
        self._resume_dir: RunDir | None = None
        if resume_from is not None:
            self._resume_dir = RunDir.open_existing(resume_from)
            self._checkpoint = self._resume_dir.load_checkpoint()
            base = self._checkpoint.get("config")
            if not isinstance(base, dict):
                raise UserError(f"resume: {resume_from}: the checkpoint holds no config")
            config = build_config(merge(base, overrides or {}), "resume config")
        elif config is None:
            config = build_config(merge({}, overrides or {}))
        elif overrides:
            config = build_config(merge(config.to_dict(), overrides))
        self.config = config
        self.task = task or make_task(config.task.name, config.task.params)
        self.devices: list[Device] = parse_devices(config.devices.use)
        if config.devices.output >= len(self.devices):
            raise UserError(
                f"devices.output = {config.devices.output}: only {len(self.devices)} device(s) listed "
                f"({config.devices.use})"
            )
        if config.devices.weights and len(config.devices.weights) != len(self.devices):
            raise UserError(f"devices.weights: {len(config.devices.weights)} weights for {len(self.devices)} devices")
        if config.train.precision == "fp16" and not self.devices[0].is_cuda:
            raise UserError("train.precision = fp16: fp16 needs a GPU; on CPU lanes use bf16 or fp32")
        self.callbacks = list(callbacks)
        self.run_dir: RunDir | None = None
        self.sampler: TelemetrySampler | None = None
        self.step = 0

    # -- setup ----------------------------------------------------------------------------------
    def _setup(self) -> None:
        cfg = self.config
        torch.manual_seed(cfg.train.seed)
        self.backend = make_backend(self.devices, cfg.devices.output)
        self.strategy = ReplicateEachStep(self.backend, cfg.train.precision)
        dev = self.backend.model_device
        self.loader = build_loader(self.task, cfg, dev if dev.type == "cuda" else None)
        self.model = self.task.build_model().to(dev)
        self.optimizer = build_optimizer(self.model.parameters(), cfg.optim)
        accum = cfg.train.grad_accum
        per_epoch = self.loader.per_epoch
        if cfg.train.steps is None and per_epoch is None:
            raise UserError(
                f"task {self.task.name}: its data is a stream of unknown length (an IterableDataset): set train.steps"
            )
        self.total_steps = cfg.train.steps or math.ceil(cfg.train.epochs * per_epoch / accum)
        self.scaler = torch.amp.GradScaler(self.backend.device_type, enabled=cfg.train.precision == "fp16")
        weights = cfg.devices.weights or None
        self._sizes_cache: dict[int, list[int]] = {}
        self._weights = weights
        self.timer = self.backend.make_timer()
        if self._checkpoint is not None:
            ck = self._checkpoint
            self.model.load_state_dict(ck["model"])
            self.optimizer.load_state_dict(ck["optimizer"])
            if ck.get("scaler"):
                self.scaler.load_state_dict(ck["scaler"])
            if isinstance(ck.get("rng"), torch.Tensor):
                torch.set_rng_state(ck["rng"])
            self.step = int(ck["step"])
        # The loader's workers start here, before the telemetry thread, at the run's next micro-batch.
        self.loader.start(self.step * accum, self.total_steps * accum)

    def _sizes(self, batch: int) -> list[int]:
        s = self._sizes_cache.get(batch)
        if s is None:
            s = chunk_sizes(batch, len(self.devices), self._weights)
            self._sizes_cache[batch] = s
        return s

    # -- the loop -------------------------------------------------------------------------------
    def run(self) -> RunResult:
        cfg = self.config
        try:
            self._setup()
        except UserError:
            raise
        except Exception as e:
            raise UserError(f"task {self.task.name}: setup failed{_where(e)}: {_one_line(e)}") from None
        if self._resume_dir is not None:
            self.run_dir = self._resume_dir
        else:
            self.run_dir = RunDir.create(cfg.run.runs_dir, cfg.run.name)
        rd = self.run_dir
        rd.write_json(CONFIG, cfg.to_dict())
        rd.write_json(ENVIRONMENT, environment())
        self.callbacks.insert(0, _MetricsWriter(rd))
        self.sampler = self._make_sampler()
        self.t_start = time.time()
        self._energy_at_log = self._energy_at_epoch = 0.0
        self._epoch = self._epoch_at(self.step)
        self._last_train: dict[str, Any] = {}
        self._last_eval: dict[str, Any] = {}
        resumed = self._checkpoint is not None
        status, message, tb = "finished", None, None
        try:
            rd.set_status("running", step=self.step, total_steps=self.total_steps)
            for cb in self.callbacks:
                cb.on_train_start(self)
            extra = {"resumed_from_step": self.step} if resumed else {}
            self._event("started", total_steps=self.total_steps, **extra)
            for message in balance_warnings(self.devices):
                self._event("warning", message=message)
            if self.sampler is not None:
                self.sampler.start()
            status, message = self._loop()
        except Exception as e:
            status = "failed"
            message = f"task {self.task.name}, step {self.step + 1}: {_one_line(e)}"
            tb = traceback.format_exc()
            if isinstance(e, torch.OutOfMemoryError):
                message += " (hint: a smaller batch, fewer replicas per GPU, or an uneven split)"
                _release_cuda_memory()
        finally:
            result = self._finish(status, message, tb)
        return result

    def _loop(self) -> tuple[str, str | None]:
        cfg = self.config
        log_every, eval_every = cfg.train.log_every, cfg.train.eval_every
        ckpt_every, accum = cfg.train.checkpoint_every, cfg.train.grad_accum
        n = len(self.devices)
        self._window_reset(n)
        while self.step < self.total_steps:
            self.control.wait_while_held()
            if self.control.pause_requested and not self.control.stop_requested:
                self._pause()
            if self.control.stop_requested:
                self._save_checkpoint()
                return "stopped", f"stopped at step {self.step}"
            self._train_step(accum)
            self.step += 1
            epoch = self._epoch_at(self.step)
            if epoch > self._epoch:
                self._epoch_end(epoch)
            last = self.step == self.total_steps
            if self.step % log_every == 0 or last:
                try:
                    self._log()
                except NonFiniteLoss as e:
                    # Keep the last good checkpoint: nothing is saved from here on.
                    if cfg.train.on_nonfinite == "pause":
                        self._pause(str(e))
                    return "stopped", str(e)
            if (eval_every and self.step % eval_every == 0) or last:
                self._evaluate()
            if (ckpt_every and self.step % ckpt_every == 0) or last:
                self._save_checkpoint()
        return "finished", None

    def _epoch_at(self, step: int) -> int:
        per_epoch = self.loader.per_epoch
        return step * self.config.train.grad_accum // per_epoch if per_epoch else 0

    def _train_step(self, accum: int) -> None:
        cfg = self.config
        timer, opt = self.timer, self.optimizer
        for group in opt.param_groups:
            group["lr"] = lr_at(self.step, self.total_steps, cfg.optim.lr, cfg.schedule)
        for k in range(accum):
            timer.mark(None)
            t0 = time.perf_counter()
            inputs, target, size = self.loader.next()
            timer.add("data", time.perf_counter() - t0)
            sizes = self._sizes(size)
            out = self.strategy.forward_loss(self.model, inputs, target, self.task.loss, sizes, timer)
            timer.mark("backward")
            if k == 0:
                # Free the last step's gradients just before backward (the order of PyTorch's own
                # examples): backward then reuses those blocks; freeing them before the forward
                # costs ~3% on the CPU in fresh pages (bench/step_overhead.py).
                opt.zero_grad(set_to_none=True)
            loss = out.loss / accum if accum > 1 else out.loss
            self.scaler.scale(loss).backward()
            if self._lane_sum is None:  # accumulate in the loss's own dtype: no cast per step
                self._lane_sum = torch.zeros(
                    len(self._lane_count), dtype=out.lane_losses.dtype, device=out.lane_losses.device
                )
            if len(self._lane_count) > 1:  # with one lane the combined loss is the lane's loss
                self._loss_sum = out.loss.detach() if self._loss_sum is None else self._loss_sum + out.loss.detach()
            if len(out.lanes) == len(self._lane_count):
                self._lane_sum += out.lane_losses
            else:
                idx = torch.tensor(out.lanes, device=self._lane_sum.device)
                self._lane_sum.index_add_(0, idx, out.lane_losses.to(self._lane_sum.dtype))
            for lane in out.lanes:
                self._lane_count[lane] += 1
            self._micro += 1
            self._samples += size
        timer.mark("optimizer")
        if cfg.train.grad_clip > 0:
            self.scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.train.grad_clip)
            self._grad_norm_sum = self._grad_norm_sum + norm.detach()
        self.scaler.step(opt)
        self.scaler.update()
        timer.end_step()
        self._steps_in_window += 1

    def _window_reset(self, n: int) -> None:
        self._loss_sum: torch.Tensor | None = None
        self._lane_sum: torch.Tensor | None = None
        self._lane_count = [0] * n
        self._grad_norm_sum: torch.Tensor | float = 0.0
        self._micro = 0
        self._samples = 0
        self._steps_in_window = 0
        self._t_window = time.perf_counter()

    def _log(self) -> None:
        if self._micro == 0 or self._lane_sum is None:
            return
        # The one device sync of a log window: all values come back in a single transfer.
        loss_sum = self._lane_sum if self._loss_sum is None else self._loss_sum
        parts = [loss_sum.reshape(1), self._lane_sum]
        if isinstance(self._grad_norm_sum, torch.Tensor):
            parts.append(self._grad_norm_sum.to(self._lane_sum).reshape(1))
        values = torch.cat(parts).tolist()
        dt = time.perf_counter() - self._t_window
        loss = values[0] / self._micro
        names = self.backend.lane_names
        device_loss = {names[i]: values[1 + i] / c for i, c in enumerate(self._lane_count) if c}
        rec: dict[str, Any] = {
            "kind": "train",
            "step": self.step,
            "epoch": round(self.step * self.config.train.grad_accum / self.loader.per_epoch, 4)
            if self.loader.per_epoch
            else None,
            "wall_time": time.time(),
            "loss": loss,
            "device_loss": device_loss,
            "lr": self.optimizer.param_groups[0]["lr"],
            "samples_per_s": self._samples / dt if dt > 0 else None,
            "step_ms": 1000.0 * dt / max(1, self._steps_in_window),
            "phase_ms": self.timer.read(),
        }
        if len(values) > 1 + len(names):
            rec["grad_norm"] = values[-1] / max(1, self._steps_in_window)
        busy = self.backend.lane_busy_seconds()
        if busy is not None:
            rec["lane_busy_s"] = dict(zip(names, busy, strict=True))
        energy = self.sampler.energy_j() if self.sampler is not None else None
        if energy is not None:
            rec["energy_j"] = energy
            used = energy - self._energy_at_log
            if used > 0:
                rec["samples_per_j"] = self._samples / used  # = samples per second per watt
            self._energy_at_log = energy
        self._last_train = rec
        for cb in self.callbacks:
            cb.on_log(rec)
        first = self.step - self._steps_in_window + 1
        self._window_reset(len(self.devices))
        if not math.isfinite(loss):
            bad = [k for k, v in device_loss.items() if not math.isfinite(v)] or names
            where = f"at step {self.step}" if first == self.step else f"between steps {first} and {self.step}"
            raise NonFiniteLoss(f"loss became {loss} {where} on device {', '.join(bad)}")

    def _epoch_end(self, epoch: int) -> None:
        """Mark an epoch's end; where the GPUs report power, with the energy it took."""
        extra: dict[str, Any] = {"epoch": epoch}
        energy = self.sampler.energy_j() if self.sampler is not None else None
        if energy is not None:
            used = energy - self._energy_at_epoch
            extra["energy_j"] = used
            if used > 0:
                extra["samples_per_j"] = (epoch - self._epoch) * (self.loader.n or 0) / used
            self._energy_at_epoch = energy
        self._epoch = epoch
        self._event("epoch_end", **extra)

    def _evaluate(self) -> None:
        if not self.loader.has_val:
            return
        model, task = self.model, self.task
        was_training = model.training
        model.eval()
        total = None
        count = 0
        keys: list[str] = []
        dev_out = self.backend.output_device
        with torch.no_grad():
            for inputs, target, size in self.loader.eval_batches():
                output = self.strategy.forward(model, inputs, self._sizes(size))
                target = move_tree(target, dev_out)
                loss = task.loss(output, target)
                metrics = task.metrics(output, target)
                keys = list(metrics)
                vec = torch.stack([loss.float(), *(torch.as_tensor(metrics[k]).float() for k in keys)]) * size
                total = vec if total is None else total + vec
                count += size
        model.train(was_training)
        assert total is not None
        values = (total / count).tolist()
        rec = {
            "kind": "eval",
            "step": self.step,
            "wall_time": time.time(),
            "val_loss": values[0],
            "metrics": dict(zip(keys, values[1:], strict=True)),
        }
        text = task.sample_text(model, self.backend.model_device, self.step)
        if text:
            rec["sample"] = text
            assert self.run_dir is not None
            self.run_dir.append_text(SAMPLES, f"--- step {self.step}\n{text}\n")
        self._last_eval = rec
        for cb in self.callbacks:
            cb.on_eval(rec)

    def _pause(self, reason: str | None = None) -> None:
        if reason:
            self.control.pause()
        assert self.run_dir is not None
        self.run_dir.set_status("paused", reason, step=self.step, total_steps=self.total_steps)
        self._event("paused", **({"message": reason} if reason else {}))
        while not self.control.wait_while_paused(0.2):
            pass
        if not self.control.stop_requested:
            self.run_dir.set_status("running", step=self.step, total_steps=self.total_steps)
            self._event("resumed")
        self._t_window = time.perf_counter()  # paused time is not training time

    def _event(self, name: str, **extra: Any) -> None:
        rec = {"kind": "event", "event": name, "step": self.step, "wall_time": time.time(), **extra}
        for cb in self.callbacks:
            cb.on_event(rec)

    def checkpoint_state(self) -> dict[str, Any]:
        """What a checkpoint holds; loadable with ``torch.load(path, weights_only=True)``."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else None,
            "step": self.step,
            "total_steps": self.total_steps,
            "config": self.config.to_dict(),
            "rng": torch.get_rng_state(),
            "multilane": __version__,
        }

    def _save_checkpoint(self) -> None:
        assert self.run_dir is not None
        self.run_dir.save_checkpoint(self.checkpoint_state())
        self._checkpoint_step = self.step

    def _make_sampler(self) -> TelemetrySampler | None:
        t = self.config.telemetry
        if not t.enabled:
            return None
        return TelemetrySampler(
            self.devices,
            self.backend.lane_names,
            self._telemetry,
            rate_hz=t.rate_hz,
            record_s=t.record_s,
            busy_seconds=self.backend.lane_busy_seconds,
            output_index=self.config.devices.output,
        )

    def _telemetry(self, record: dict[str, Any]) -> None:
        for cb in self.callbacks:
            if record["kind"] == "telemetry":
                cb.on_telemetry(record)
            else:
                cb.on_event({**record, "step": self.step})

    def _finish(self, status: str, message: str | None, tb: str | None) -> RunResult:
        rd = self.run_dir
        assert rd is not None
        if getattr(self, "sampler", None) is not None:
            with contextlib.suppress(Exception):
                self.sampler.stop()
        elapsed = time.time() - self.t_start
        if tb:
            rd.write_error(tb)
        extra: dict[str, Any] = {"message": message} if message else {}
        if tb:
            extra["traceback"] = tb
        rd.set_status(status, message, step=self.step, total_steps=getattr(self, "total_steps", None))
        with contextlib.suppress(Exception):  # reporting must not hide the run's own outcome
            self._event(status, **extra)
        rd.close()
        if hasattr(self, "loader"):
            self.loader.close()
        if hasattr(self, "backend"):
            self.backend.close()
        result = RunResult(
            status=status,
            step=self.step,
            run_dir=rd.path,
            message=message,
            traceback=tb,
            last_train=self._last_train,
            last_eval=self._last_eval,
            elapsed_s=elapsed,
        )
        for cb in self.callbacks:
            with contextlib.suppress(Exception):
                cb.on_train_end(result)
        return result


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    head = text[0] if text else ""
    # torch's replica errors read "Caught X in replica i on device d." then the original traceback:
    # keep that line and the original error's last line.
    if head.startswith("Caught ") and len(text) > 1:
        return f"{head} {text[-1].strip()}"
    return f"{type(e).__name__}: {head}" if head else type(e).__name__


def _where(e: BaseException) -> str:
    frames = traceback.extract_tb(e.__traceback__)
    return f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""


def _release_cuda_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
