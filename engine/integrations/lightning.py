"""Lightning: ``Trainer(callbacks=[MultilaneCallback()])`` makes the run a Multilane run folder.

Each optimizer step becomes a train record: the loss ``training_step`` returned (the mean of the
step's micro-batches), each rank's own under ddp (``device_loss``), the learning rate the step used,
its time and the epoch. Validation becomes an eval record (``trainer.callback_metrics`` whose names
hold "val"). Stop in the app (the run folder's control file) sets ``trainer.should_stop`` at the next
step, after saving a Lightning checkpoint when the trainer has a checkpoint callback; Pause waits
between steps. A failure ends the run ``failed`` with its traceback; under ddp the rank that failed
first is named, not the peers that lost it (recorder.py). Every ``health.every`` steps, per-layer
health as the engine's own runs record it (health.py), and under DDP the gradient noise scale from
each rank's gradient. Needs the ``[lightning]`` extra; this module is the only one that imports
Lightning.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from multilane.integrations.extras import MissingExtra, require

try:
    pl = require("lightning.pytorch", "lightning", "multilane.integrations.lightning")
except MissingExtra:
    try:  # the older package name carries the same Trainer
        pl = require("pytorch_lightning", "lightning", "multilane.integrations.lightning")
    except MissingExtra as e:
        raise MissingExtra(str(e).replace("pytorch_lightning", "lightning")) from None

# After the library: without it, the one line comes before torch is imported.
from multilane.engine.config import HealthSection
from multilane.engine.health.lane_grads import is_sharded
from multilane.integrations.health import SHARDED, LoopHealth, batch_size, health_section
from multilane.integrations.recorder import RunRecorder

__all__ = ["MultilaneCallback"]


def _scalar(v: Any) -> float | None:
    try:
        if hasattr(v, "numel") and v.numel() != 1:
            return None
        return float(v)
    except (TypeError, ValueError):
        return None


def split_validation(metrics: dict[str, Any]) -> tuple[float | None, dict[str, float]]:
    """``val_loss`` and the other validation metrics, from Lightning's ``callback_metrics``."""
    vals = {k: f for k, v in metrics.items() if "val" in k.lower() and (f := _scalar(v)) is not None}
    names = [k for k in ("val_loss", "val/loss", "validation_loss", "loss/val") if k in vals]
    names = names or [k for k in vals if "loss" in k.lower()]
    val_loss = vals.pop(names[0]) if names else None
    return val_loss, vals


class MultilaneCallback(pl.Callback):
    """Writes the Lightning run into ``<runs_dir>/<timestamp>-<name>/`` (as ``--runs-dir`` and
    ``--name``); the app follows it live (File → Follow run, the runs table) and its Stop and Pause act
    on it."""

    def __init__(
        self,
        runs_dir: str | Path = "runs",
        name: str = "lightning",
        telemetry: bool = True,
        health: HealthSection | dict[str, Any] | None = None,
    ) -> None:
        """``health``: the run's ``health`` section (its keys as a dict; by default on, as a native run)."""
        super().__init__()
        self.recorder = RunRecorder(runs_dir, name, telemetry)
        self.health_config = health_section(health)
        self.health: LoopHealth | None = None
        self._t0: float | None = None
        self._losses: list[float] = []
        self._lr: float | None = None
        self._done_step = 0
        self._samples = 0  # this rank's samples in the step so far

    @property
    def run_dir(self) -> Path | None:
        """The run folder (on rank 0, once training started)."""
        return self.recorder.run_dir

    # -- start ----------------------------------------------------------------------------------
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        loader = getattr(trainer, "train_dataloader", None)
        batch = getattr(loader, "batch_size", None)
        opt = trainer.optimizers[0] if trainer.optimizers else None
        optimizer = (type(opt).__name__.lower(), float(opt.param_groups[0]["lr"])) if opt is not None else None
        steps = trainer.estimated_stepping_batches
        self._done_step = trainer.global_step
        kind = type(trainer.strategy).__name__
        sharded = trainer.world_size > 1 and is_sharded(pl_module)  # FSDP2 (ModelParallelStrategy)
        self.recorder.open(
            "lightning",
            type(pl_module).__name__,
            pl_module.device,
            total_steps=int(steps) if steps != float("inf") else None,
            batch_size=batch * trainer.world_size if isinstance(batch, int) else None,
            optimizer=optimizer,
            extra={
                "version": pl.__version__,
                "accumulate_grad_batches": trainer.accumulate_grad_batches,
                "max_epochs": trainer.max_epochs,
            },
            health=self.health_config.model_dump(mode="json"),
            strategy="fsdp" if sharded or "fsdp" in kind.lower() else None,
        )
        rec = self.recorder
        self.health = LoopHealth(self.health_config, pl_module.device, rec.rank, rec.world)
        ddp = getattr(trainer.strategy, "model", None)
        if self.health.every and sharded:  # each rank's shards, summed over the ranks
            self.health.attach_sharded(pl_module, kind, trainer.accumulate_grad_batches)
        elif self.health.every and any(s in kind.lower() for s in ("fsdp", "deepspeed")):
            self.health.switch_off(SHARDED.format(kind))
            rec.event("health_off", message=self.health.note)
        elif rec.world > 1 and hasattr(ddp, "register_comm_hook"):  # DistributedDataParallel
            self.health.attach_ddp(ddp)
        elif rec.world > 1 and self.health.every:
            self.health.note = f"the noise scale is measured under ddp only, not {type(trainer.strategy).__name__}"
        if self.health.note and self.health.every and rec.world > 1:  # one device: the view says why
            rec.event("noise_scale", message=self.health.note)

    # -- each step ------------------------------------------------------------------------------
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._t0 is None:  # the step's first micro-batch
            self._t0 = time.perf_counter()
            opt = trainer.optimizers[0] if trainer.optimizers else None
            self._lr = float(opt.param_groups[0]["lr"]) if opt is not None else None
            if self.health is not None:
                self.health.start(trainer.global_step + 1, pl_module, trainer.accumulate_grad_batches)
        if self.health is not None:
            self.health.micro(batch_size(batch))

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        """After the step's last backward (the ranks' gradients combined, unscaled by Lightning's AMP
        plugin), before gradient clipping and the optimizer's update."""
        h = self.health
        if h is None or not h.on or h.took_gradients:  # manual optimization's later optimizers: the first's
            return
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        lane_scale = scaler.get_scale() if scaler is not None and scaler.is_enabled() else None
        h.gradients(pl_module, None, lane_scale)
        h.before_update()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        value = _scalar(loss) if loss is not None else None
        if value is not None and pl_module.automatic_optimization:
            # Lightning hands on the loss divided by accumulate_grad_batches (what backward used);
            # the step's loss is the mean of what training_step returned
            value *= trainer.accumulate_grad_batches
        if value is None:  # manual optimization without a returned loss: what the module logged
            value = _scalar(trainer.callback_metrics.get("train_loss", trainer.callback_metrics.get("loss")))
        if value is not None:
            self._losses.append(value)
        self._samples += batch_size(batch)
        step = trainer.global_step
        if step == self._done_step:
            return  # a micro-batch of gradient accumulation: the step is not over yet
        self._done_step = step
        step_s = time.perf_counter() - (self._t0 or time.perf_counter())
        mine = sum(self._losses) / len(self._losses) if self._losses else None
        self._t0, self._losses = None, []
        samples, self._samples = self._samples, 0
        rec = self.recorder
        noise = None
        if self.health is not None:
            self.health.after_update()
            noise, sampled = self.health.end_step()  # under ddp, on a sampled step, a collective
            for h in sampled:
                rec.health(h)
        end = rec.step_end(step, mine, step_s, samples if samples > 0 else None)
        if end.losses:
            rec.train(
                step,
                sum(end.losses.values()) / len(end.losses),
                end.losses,
                lr=self._lr,
                step_ms=1000.0 * step_s,
                samples_per_s=end.samples / step_s if end.samples and step_s > 0 else None,
                epoch=trainer.current_epoch,
                noise=noise,
            )
        if end.stop:
            self._stop(trainer)

    def _stop(self, trainer: Any) -> None:
        """Every rank: a checkpoint where the user's trainer keeps them, then stop at this step."""
        ckpt = trainer.checkpoint_callback
        if ckpt is not None and getattr(ckpt, "dirpath", None):
            path = Path(ckpt.dirpath) / f"stopped-step={trainer.global_step}.ckpt"
            trainer.save_checkpoint(str(path))  # a collective: rank 0 writes
            self.recorder.event("checkpoint", path=str(path))
        trainer.should_stop = True

    # -- validation -----------------------------------------------------------------------------
    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.sanity_checking or self.recorder.rd is None:
            return
        val_loss, metrics = split_validation(dict(trainer.callback_metrics))
        if val_loss is not None or metrics:
            self.recorder.eval(trainer.global_step, val_loss, metrics, epoch=trainer.current_epoch)

    # -- end ------------------------------------------------------------------------------------
    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.recorder.step = trainer.global_step
        self.recorder.finish("stopped" if self.recorder.stop_asked else "finished")

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.recorder.fail(exception)  # under ddp: the rank that caused it, not its peers' "connection closed"

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.recorder.finish("failed", "training ended without reporting an outcome")
