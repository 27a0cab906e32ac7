"""Hugging Face: ``Trainer(..., callbacks=[MultilaneCallback()])`` makes the run a Multilane run folder.

What the ``Trainer`` logs (``on_log``, every ``logging_steps``) becomes the run's records: the loss
(the mean over the logging window, as the Trainer reports it), the learning rate, the gradient norm,
the epoch, and the mean step time of the window; evaluation logs (``eval_*``) become eval records.
Stop in the app sets ``control.should_training_stop`` at the next step (and ``should_save`` when the
Trainer saves checkpoints); Pause waits between steps. Under ddp the Trainer's loss is already the
mean over the ranks, so no device's own loss is shown (``device_loss`` is written only for a single
process). A ``TrainerCallback`` never hears of an exception, so importing this module wraps
``Trainer.train`` (once, for every Trainer and subclass): an exception out of it ends the run of the
trainer's ``MultilaneCallback`` ``failed`` with its traceback (Ctrl+C: ``stopped``), then goes on up as
before; under ddp the rank that failed first is named (recorder.py). Every ``health.every`` steps,
per-layer health as the engine's own runs record it (health.py): the gradient is read where the
Trainer clips it (before clipping, unscaled), or at ``on_pre_optimizer_step`` when it does not clip.
Under ddp the gradient noise scale, from each rank's gradient before DDP's all-reduce, where the
Trainer weighs each rank's loss per sample (``per_sample_weighting``; else an event says why).
Needs the ``[transformers]`` extra; this module is the only one that imports transformers.
"""

from __future__ import annotations

import functools
import math
import time
from pathlib import Path
from typing import Any

from multilane.integrations.extras import require

hf = require("transformers", "transformers", "multilane.integrations.transformers")

# After the library: without it, the one line comes before torch is imported.
from multilane.engine.config import HealthSection  # noqa: E402
from multilane.integrations.health import HF_SHARDED, LoopHealth, batch_size, health_section  # noqa: E402
from multilane.integrations.recorder import RunRecorder  # noqa: E402

__all__ = ["MultilaneCallback"]

# Evaluation log entries that time the evaluation, not the model: not metrics.
_TIMING = ("runtime", "samples_per_second", "steps_per_second")

NOT_PER_SAMPLE = "the noise scale is not measured under this Hugging Face Trainer's ddp: {}"


def per_sample_weighting(trainer: Any, num_items_in_batch: Any) -> str | None:
    """None where each rank's loss is what the model returns for its micro-batch (taken as the mean
    over its samples) divided by the step's accumulation steps, DDP averaging the ranks: the
    Trainer's own rule in ``training_step`` (transformers 5.x). Else why the weighting is another."""
    if getattr(trainer.args, "n_gpu", 1) > 1:
        return "several GPUs in one process (DataParallel) average their losses unweighted"
    if getattr(trainer, "compute_loss_func", None) is not None:
        return "a compute_loss_func weighs the loss, in a way the Trainer's hooks do not say"
    if getattr(trainer, "label_smoother", None) is not None:
        return "label smoothing averages the loss over tokens"
    state = getattr(getattr(trainer, "accelerator", None), "gradient_state", None)
    if getattr(state, "plugin_kwargs", {}).get("sync_each_batch", False):
        return "sync_each_batch all-reduces every micro-batch, not the step's gradient once"
    scaled = getattr(trainer, "loss_is_scaled_for_ga", None)
    if scaled is None:
        scaled = bool(getattr(trainer, "model_accepts_loss_kwargs", False)) and num_items_in_batch is not None
    if scaled:
        return (
            "the model takes num_items_in_batch: its loss is summed over the tokens it counts and divided by "
            "the step's token count (over every device with average_tokens_across_devices); which tokens "
            "count is the model's own rule"
        )
    return None


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


class MultilaneCallback(hf.TrainerCallback):
    """Writes the ``transformers.Trainer`` run into ``<runs_dir>/<timestamp>-<name>/``; the app
    follows it live and its Stop and Pause act on it."""

    def __init__(
        self,
        runs_dir: str | Path = "runs",
        name: str = "transformers",
        telemetry: bool = True,
        health: HealthSection | dict[str, Any] | None = None,
    ) -> None:
        """``health``: the run's ``health`` section (its keys as a dict; by default on, as a native run)."""
        self.recorder = RunRecorder(runs_dir, name, telemetry)
        self.health_config = health_section(health)
        self.health: LoopHealth | None = None
        self._trainer: Any = None  # the Trainer whose train() runs (set by the wrapped Trainer.train)
        self._model: Any = None
        self._noise: dict[str, Any] | None = None
        self._t0: float | None = None
        self._step_s: list[float] = []
        self._step_samples: list[int | None] = []  # each step's samples over the ranks (None: not counted)
        self._samples = 0  # this rank's samples in the step so far
        self._counted = False  # the Trainer's training_step is wrapped: the samples are counted
        self._samples_per_step = 0

    @property
    def run_dir(self) -> Path | None:
        """The run folder (on the main process, once training started)."""
        return self.recorder.run_dir

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        world = max(1, int(getattr(args, "world_size", 1) or 1))
        # nominal, where the Trainer's training_step cannot be wrapped to count the batches it gets
        self._samples_per_step = args.per_device_train_batch_size * world * args.gradient_accumulation_steps
        kind = getattr(getattr(self._trainer, "accelerator", None), "distributed_type", None)
        kind = str(getattr(kind, "value", kind))  # what accelerate runs (on CPU never FSDP: docs/integrations.md)
        self.recorder.open(
            "transformers",
            type(model).__name__ if model is not None else "model",
            args.device,
            total_steps=state.max_steps or None,
            batch_size=args.per_device_train_batch_size * world,
            optimizer=(str(getattr(args.optim, "value", args.optim)), float(args.learning_rate)),
            extra={
                "version": hf.__version__,
                "gradient_accumulation_steps": args.gradient_accumulation_steps,
                "logging_steps": args.logging_steps,
            },
            health=self.health_config.model_dump(mode="json"),
            strategy="fsdp" if kind.upper() == "FSDP" else None,
        )
        rec = self.recorder
        self.health = LoopHealth(self.health_config, args.device, rec.rank, rec.world)
        self._model = model
        wrapped = getattr(self._trainer, "model_wrapped", None)
        if self.health.every and kind.upper() in ("FSDP", "DEEPSPEED"):
            self.health.switch_off(HF_SHARDED.format(kind))
            rec.event("health_off", message=self.health.note)
        elif rec.world > 1 and self.health.every and hasattr(wrapped, "register_comm_hook"):  # DDP
            self.health.attach_ddp(wrapped)  # each rank's gradient before the all-reduce
        elif rec.world > 1 and self.health.every:
            self.health.note = f"the noise scale is measured under ddp only, not {kind}"
        if self.health.note and self.health.every and rec.world > 1:  # one device: the view says why
            rec.event("noise_scale", message=self.health.note)
        clip = getattr(self._trainer, "_clip_grad_norm", None)
        if self.health.every and callable(clip) and (args.max_grad_norm or 0) > 0:
            self._trainer._clip_grad_norm = self._before_clipping(clip)
        step = getattr(self._trainer, "training_step", None)
        self._counted = callable(step)
        if callable(step):  # each micro-batch's samples (the step hooks are handed no batch); health's
            self._trainer.training_step = self._each_micro_batch(step)

    def _each_micro_batch(self, training_step: Any) -> Any:
        """The Trainer's ``training_step`` (this Trainer only): each micro-batch's samples on this rank
        (the step's throughput: an epoch's last batch may be short), a sampled step's micro-batch sizes,
        and under ddp whether its loss weighting is the one the noise scale takes (else no noise scale)."""

        @functools.wraps(training_step)
        def wrapped(model: Any, inputs: Any, num_items_in_batch: Any = None, *args: Any, **kwargs: Any) -> Any:
            self._samples += batch_size(inputs)
            h = self.health
            if h is not None and h.measures_noise:
                why = per_sample_weighting(self._trainer, num_items_in_batch)
                if why is not None:  # every rank: the same arguments and batches' shapes
                    h.drop_noise(NOT_PER_SAMPLE.format(why))
                    self.recorder.event("noise_scale", message=h.note)
            if h is not None and h.on:
                h.accum = max(1, int(getattr(self._trainer, "current_gradient_accumulation_steps", h.accum)))
                h.micro(batch_size(inputs))
            return training_step(model, inputs, num_items_in_batch, *args, **kwargs)

        wrapped.multilane_health = True
        return wrapped

    def _before_clipping(self, clip: Any) -> Any:
        """The Trainer's clipping (this Trainer only), reading a sampled step's gradient first: the
        whole step's, combined over the ranks, divided by the loss scale it still carries."""

        @functools.wraps(clip)
        def wrapped(model: Any, *args: Any, **kwargs: Any) -> Any:
            h = self.health
            if h is not None and h.on:
                scaler = getattr(getattr(self._trainer, "accelerator", None), "scaler", None)
                scale = scaler.get_scale() if scaler is not None and scaler.is_enabled() else None
                h.gradients(self._model if self._model is not None else model, scale)
            return clip(model, *args, **kwargs)

        wrapped.multilane_health = True
        return wrapped

    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self._t0 = time.perf_counter()
        if self.health is not None and model is not None:
            self._model = model
            self.health.start(state.global_step + 1, model, args.gradient_accumulation_steps)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """After clipping (read before it, where the Trainer clips) and before the optimizer's step."""
        h = self.health
        if h is not None and h.on:
            # unscaled here (the Trainer's grad-norm reading unscales it); the ddp hook saw it scaled
            scaler = getattr(getattr(self._trainer, "accelerator", None), "scaler", None)
            lane_scale = scaler.get_scale() if scaler is not None and scaler.is_enabled() else None
            h.gradients(self._model, None, lane_scale)  # a no-op when read before clipping
            h.before_update()

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        h = self.health
        if h is None:
            return
        h.after_update()
        self._noise, sampled = h.end_step()
        for record in sampled:
            self.recorder.health(record)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        step_s = time.perf_counter() - (self._t0 or time.perf_counter())
        self._step_s.append(step_s)
        samples, self._samples = self._samples, 0
        counted = samples if self._counted else None  # a rank without a batch this step counts 0
        end = self.recorder.step_end(state.global_step, None, step_s, counted)  # a collective under ddp
        self._step_samples.append(end.samples or None)  # none counted anywhere: the nominal step
        if end.stop:
            control.should_training_stop = True
            if str(getattr(args.save_strategy, "value", args.save_strategy)) != "no":
                control.should_save = True  # the Trainer's own checkpoint of the step it stopped at

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        logs = logs or {}
        rec = self.recorder
        step = state.global_step
        loss = _num(logs.get("loss"))
        if loss is not None:
            times, self._step_s = self._step_s, []
            counts, self._step_samples = self._step_samples, []
            if counts and all(c is not None for c in counts):
                samples = sum(c for c in counts if c is not None)
            else:
                samples = self._samples_per_step * len(times)
            rec.train(
                step,
                loss,
                {rec.key: loss} if rec.world == 1 else None,
                lr=_num(logs.get("learning_rate")),
                grad_norm=_finite(_num(logs.get("grad_norm"))),
                epoch=_num(logs.get("epoch")),
                step_ms=1000.0 * sum(times) / len(times) if times else None,
                samples_per_s=samples / sum(times) if times and sum(times) > 0 else None,
                noise=self._noise,
            )
        evals = {k[5:]: v for k, v in logs.items() if k.startswith("eval_") and _num(v) is not None}
        if evals:
            metrics = {k: float(v) for k, v in evals.items() if k != "loss" and k not in _TIMING}
            rec.eval(step, _num(evals.get("loss")), metrics, epoch=_num(logs.get("epoch")))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        _unwrap_clipping(self._trainer)
        self.recorder.step = state.global_step
        self.recorder.finish("stopped" if self.recorder.stop_asked else "finished")


def _record_failures(train: Any) -> Any:
    """``Trainer.train`` that ends its Multilane runs ``failed`` when it raises (the callbacks cannot see it)."""

    @functools.wraps(train)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        for cb in getattr(getattr(self, "callback_handler", None), "callbacks", ()):
            if isinstance(cb, MultilaneCallback):
                cb._trainer = self  # its hooks are handed no Trainer: health reads its clipping
        try:
            return train(self, *args, **kwargs)
        except BaseException as e:
            _unwrap_clipping(self)
            handler = getattr(self, "callback_handler", None)
            for cb in getattr(handler, "callbacks", ()):
                if isinstance(cb, MultilaneCallback):
                    cb.recorder.fail(e)
            raise

    wrapped.multilane_records_failures = True
    return wrapped


if not getattr(hf.Trainer.train, "multilane_records_failures", False):
    hf.Trainer.train = _record_failures(hf.Trainer.train)


def _unwrap_clipping(trainer: Any) -> None:
    """The Trainer's own clipping and training step again (health wrapped them for one ``train()``)."""
    for name in ("_clip_grad_norm", "training_step"):
        mine = getattr(trainer, "__dict__", {}).get(name)
        if getattr(mine, "multilane_health", False):
            delattr(trainer, name)


def _finite(v: float | None) -> float | None:
    return v if v is not None and math.isfinite(v) else None
