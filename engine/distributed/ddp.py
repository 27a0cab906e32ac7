"""The ddp strategy: one process per device, DistributedDataParallel, under the engine's one loop.

The loop (engine/run/trainer.py) calls it at its named points: each rank takes its shard of global
micro-batch ``m`` (the same global batches as the single-process engine), scales its shard loss so
that DDP's equal-weight gradient average is the full-batch gradient, gathers the log window to every
rank once per window, evaluates its shard of the validation set, and agrees with the other ranks on
pause and stop (agreement.py). Rank 0 writes the run folder; the other ranks write nothing.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from multilane.engine.data.loader import build_loader
from multilane.engine.distributed import NODE_FILE_ENV
from multilane.engine.distributed.agreement import RankAgreement
from multilane.engine.distributed.batchnorm import convert_rank_batchnorm, touch_exchanges
from multilane.engine.distributed.evaluation import evaluate_shards
from multilane.engine.distributed.failures import clear_notes
from multilane.engine.distributed.rank import NullRunDir, RankInfo, RankTelemetry, cpu_threads_per_rank
from multilane.engine.distributed.rank_state import (
    RankRules,
    RankStreams,
    build_ddp,
    check_param_writes,
    param_versions,
    shard_forward,
    weight_share,
    zero_loss,
)
from multilane.engine.distributed.shards import RankLoader
from multilane.engine.distributed.window import ShardWindow, combine
from multilane.engine.errors import UserError
from multilane.engine.health.lane_grads import ddp_comm_hook
from multilane.engine.parallel import chunk_sizes
from multilane.engine.parallel.strategy import AUTOCAST_DTYPES
from multilane.engine.parallel.timing import CudaPhaseTimer, PhaseTimer
from multilane.engine.run import checkpointer
from multilane.engine.run.control import RunControl
from multilane.engine.run.evaluation import write_sample
from multilane.engine.run.lanes import LanesReplay
from multilane.engine.run.run_spec import open_run_dir, planned_steps
from multilane.engine.rundir.runlog import RunDir
from multilane.engine.tasks import loss_weight_fn
from multilane.engine.telemetry.memory_split import gathered_rank_memory
from multilane.engine.telemetry.sampler import TelemetrySampler
from multilane.engine.tensors.features import check_model
from multilane.engine.tensors.optim import build_optimizer

if TYPE_CHECKING:
    from multilane.engine.health.tracer import Tracer
    from multilane.engine.run.trainer import Trainer

RANK_LOCK_WAIT_S = 20.0
"""How long rank 0 waits for a run folder's lock that a rank of an earlier launch still holds."""


class Ddp(RankAgreement):
    """The ddp strategy of one rank; the process group must be initialised.

    ``requests`` takes this rank's own stop and pause requests (signals, the control file); the
    loop acts on them only once every rank agrees (the loop's ``control``), so all ranks stop at the
    same step. ``run_dir``: the folder the launcher made for the run.
    """

    sharded = False

    def __init__(self, info: RankInfo, requests: RunControl | None = None, run_dir: str | Path | None = None) -> None:
        self.info = info
        self.requests = requests or RunControl()
        self._given_run_dir = Path(run_dir) if run_dir else None
        self._pending: tuple[Any, torch.Tensor] | None = None
        self._keys: list[str] = [info.key]
        self._parent = os.getppid()
        self.place = (info.device, info.rank, info.world)  # the rank's memory meter measures its device
        self.control_group: Any = None
        self.ddp: Any = None

    def open_resume_dir(self, path: str | Path) -> RunDir:
        # Rank 0 is the run folder's writer. A rank of the launch being resumed may still be on its way
        # out (its launcher already reported the failure): wait for its lock a little.
        return RunDir.open_existing(
            path, lock=self.info.is_main, wait_s=RANK_LOCK_WAIT_S, in_use_ok=not self.info.is_main
        )

    # -- setup ----------------------------------------------------------------------------------
    def _setup_rank(self, t: Trainer) -> torch.device:
        """What every rank sets up first (ddp here, fsdp in fsdp_rank.py): the seed, the threads, the
        loader, the model on the rank's device, the control group, synchronized BatchNorm."""
        cfg, info = t.config, self.info
        self.rank_telemetry = RankTelemetry(info, lambda: t.step, t.dispatch)
        torch.manual_seed(cfg.train.seed)
        if not info.device.is_cuda:
            torch.set_num_threads(cpu_threads_per_rank(info.local_world))
        dev = info.device.torch_device()
        t._phase("loading data")  # rank 0's, in the run folder's status
        t.loader = self.rank_loader(t)
        if t.memory is not None:  # the rank's peak meter: the data is not counted
            t.memory.before_model()
        t._phase("building the model")
        t.model = t.task.build_model().to(dev)
        check_model(t.model, cfg)  # every rank finds the same, before any collective
        # Pause/stop flags (and the buffers' and checkpoints' small agreements) travel on a CPU (Gloo)
        # group: no device sync per step on GPUs. (The fit probe's fake group moves nothing: its own.)
        self.control_group = dist.new_group(backend="gloo") if dist.get_backend() not in ("gloo", "fake") else None
        if cfg.devices.sync_batchnorm:  # the lanes' synchronized BatchNorm, across ranks (batchnorm.py)
            convert_rank_batchnorm(t.model, dist.new_group())
        return dev

    def rank_loader(self, t: Trainer) -> RankLoader:
        """A loader of this rank's slice of every global batch (also a NaN replay's own: ``RankReplay``)."""
        dev = self.info.device
        return RankLoader(build_loader(t.task, t.config, dev.torch_device() if dev.is_cuda else None), self.my_slice)

    def _setup_common(self, t: Trainer, dev: torch.device, what: str) -> None:
        """The optimizer, the step count, the log window's and the health's parts of every rank strategy."""
        cfg, info = t.config, self.info
        t.optimizer = build_optimizer(t.model.parameters(), cfg.optim)
        t.total_steps = planned_steps(t.task, cfg, t.loader.per_epoch)
        self._weights = cfg.devices.weights or None
        if self._weights and len(self._weights) != info.world:
            raise UserError(f"devices.weights: {len(self._weights)} weights for {info.world} {what} processes")
        self._sizes_cache: dict[int, list[int]] = {}
        t.timer = CudaPhaseTimer(dev) if info.device.is_cuda else PhaseTimer()
        t._loss_weight = loss_weight_fn(t.task)
        self._due_at: float | None = None  # a checkpoint every rank agreed is due (see checkpoint_due)

    def _restore(self, t: Trainer, dev: torch.device) -> None:
        """A checkpoint (any engine's: the open log window starts afresh), and each rank its own random
        stream, as each lane has (rank_state.py), restored from it."""
        info, saved_streams = self.info, None
        if t._checkpoint is not None:
            checkpointer.restore(t, {**t._checkpoint, "metrics_window": None, "lane_rng": None})
            saved_streams = t._checkpoint.get("lane_rng")
        self.streams = RankStreams(info.rank, info.world, dev, t.config.train.seed, self.control_group)
        self.streams.begin(saved_streams)
        self.rules = RankRules(t.model, dev, info.world, self.control_group)

    def _gather_keys(self) -> None:
        keys: list[Any] = [None] * self.info.world
        dist.all_gather_object(keys, self.info.key)
        self._keys = keys

    def setup(self, t: Trainer) -> None:
        cfg, info = t.config, self.info
        dev = self._setup_rank(t)
        self._setup_common(t, dev, "ddp")
        t.scaler = torch.amp.GradScaler(info.device.kind, enabled=cfg.train.precision == "fp16")
        t.window = ShardWindow()
        self.autocast_dtype = AUTOCAST_DTYPES.get(cfg.train.precision)
        if info.world > info.local_world:
            # Several nodes: a node that does not share host 0's runs folder (a run across hosts) has no
            # checkpoint to resume from; rank 0's travels to every rank (None when the run is new).
            box = [t._checkpoint if info.is_main else None]
            dist.broadcast_object_list(box, src=0, group=self.control_group)
            t._checkpoint = box[0]

    @property
    def settling(self) -> bool:
        """Whether this process's first steps still find what each backward reaches (``RankRules.reduce_probe``:
        under ``no_sync``, DDP's buckets idle); the fit probe (engine/plan/probe.py) measures the steps after."""
        return self.rules.reached is not None

    def health_spread(self, t: Trainer) -> dict[str, Any]:
        return {"lanes": self.info.world, "device": self.info.device.torch_device(), "exchange": dist.all_reduce}

    def attach(self, t: Trainer) -> None:
        self._restore(t, self.info.device.torch_device())
        # This process's first steps find out which parameters each rank's backward reaches (see
        # RankRules.reduce_probe); DDP walks the graph every step (find_unused_parameters) only if it must.
        self._build_ddp(t, find_unused=False)
        self._gather_keys()

    def _build_ddp(self, t: Trainer, find_unused: bool) -> None:
        self.ddp = None  # the old DDP (and its reducer's hooks) goes first
        self.ddp = build_ddp(t.model, self.info.device, find_unused)
        self._find_unused = find_unused
        if t.health.probe is not None:  # this rank's gradient, before the all-reduce (engine/health)
            self.ddp.register_comm_hook(None, ddp_comm_hook(t.health.probe, self.info.rank, self.info.world))

    def lane_names(self, t: Trainer) -> list[str]:
        return list(self._keys)

    def sizes(self, t: Trainer | None, batch: int) -> list[int]:
        s = self._sizes_cache.get(batch)
        if s is None:
            s = self._sizes_cache[batch] = chunk_sizes(batch, self.info.world, self._weights)
        return s

    def my_slice(self, size: int) -> tuple[int, int]:
        sizes = self.sizes(None, size)
        return sum(sizes[: self.info.rank]), sizes[self.info.rank]

    def open_run_dir(self, t: Trainer) -> RunDir:
        """Rank 0 opens the folder (the launcher's, the resumed one, or a new one) and tells the others."""
        rd: RunDir | None = None
        if self.info.is_main:
            if self._given_run_dir is not None and t._resume_dir is None:
                rd = RunDir(self._given_run_dir)
                (rd.path / "checkpoints").mkdir(parents=True, exist_ok=True)
                rd.acquire(RANK_LOCK_WAIT_S)  # the launcher made the folder; rank 0 is its writer
            else:
                rd = open_run_dir(t._resume_dir, t._made_run_dir, t.config)
        if rd is not None:
            clear_notes(rd.path)  # an earlier launch's failures
        path: list[Any] = [str(rd.path) if rd is not None else None]
        dist.broadcast_object_list(path, src=0)
        node_file = os.environ.get(NODE_FILE_ENV)
        if node_file and self.info.local_rank == 0:  # this node's launcher reports failures into it
            Path(node_file).write_text(path[0])
        return rd if rd is not None else NullRunDir(Path(path[0]))

    # -- one step -------------------------------------------------------------------------------
    def train_step(self, t: Trainer, accum: int) -> None:
        timer, opt, world, scaler = t.timer, t.optimizer, self.info.world, t.scaler
        self.rank_telemetry.busy.start(0)  # counted while it runs: a long step is not 0 % busy
        t.set_lr()
        health = t.health
        health.begin_step(t.step + 1, t.model, accum)
        for k in range(accum):
            timer.mark_host("data")
            inputs, target, n, size = t.loader.next_shard()
            # Gradients are averaged across ranks once per optimizer step, at its last micro-batch
            # (this process's first steps: by hand, after each; see RankRules.reduce_probe).
            probing = self.rules.reached is not None
            last = k == accum - 1 and not probing
            sync = contextlib.nullcontext() if last else self.ddp.no_sync()
            with sync:
                timer.mark("forward")
                fwd = functools.partial(self._forward, t, inputs, target, n)
                output, shard_loss, weight = self.rules.forward(fwd, n, self.sizes(t, size))
                timer.mark("backward")
                share, units = (n / size, size) if t._loss_weight is None else weight_share(weight, self.control_group)
                health.micro([share * units if share == share else 0.0], [self.info.rank], accum, units)
                if shard_loss is not None and share > 0:
                    contrib = shard_loss * share  # this shard's part of the full-batch loss
                    local = contrib * world  # DDP divides the summed gradients by the world size
                elif math.isnan(share):  # no weight in the whole batch: its loss is 0/0, as on one device
                    local = zero_loss(output, None) * math.nan  # NaN gradients, as one device's
                    contrib = local.detach().float()  # a NaN loss: every rank stops at this log
                else:  # nothing for this rank in this micro-batch: a zero gradient, still reduced
                    shard_loss = None  # (a 0/0 mean must not even reach the graph: its gradient is NaN)
                    # Through every output, and (when DDP waits for every parameter) every parameter.
                    touch_all = not self._find_unused and not probing
                    local = zero_loss(output, self.rules.params if touch_all else None, self.rules.sparse)
                    contrib = local.detach().float()
                exchanged = touch_exchanges()  # synchronized BatchNorm: every rank joins each backward
                if exchanged is not None:
                    local = local + exchanged
                self.rules.note(local)
                if k == 0:
                    opt.zero_grad(set_to_none=True)
                scaler.scale(local / accum if accum > 1 else local).backward()
            t.window.add(contrib.detach(), None if shard_loss is None else shard_loss.detach(), size, t.step + 1)
        if probing:
            probe = health.probe
            if probe is not None and probe.armed:  # no bucket reached the comm hook: this rank's gradient
                probe.add_grads(self.info.rank, [p.grad for p in t.model.parameters() if p.grad is not None], 1 / world)
            if self.rules.reduce_probe():
                self._build_ddp(t, find_unused=True)
        t.optimizer_step()
        timer.end_step()
        t.window.end_step()
        self.rank_telemetry.busy.stop(0)

    def _forward(
        self, t: Trainer, inputs: Any, target: Any, n: int
    ) -> tuple[Any, torch.Tensor | None, torch.Tensor | None]:
        """The output, this shard's loss and (with the task's ``loss_weight``) its weight."""
        return shard_forward(
            self.ddp, t.task, t._loss_weight, self.info.device.kind, self.autocast_dtype, inputs, target, n
        )

    def memory(self, t: Trainer) -> dict[str, Any]:
        """Every rank's split of its device's memory (a collective, at each log)."""
        info = self.info
        dev = info.device.torch_device()
        return gathered_rank_memory(t.model, t.optimizer, info.key, dev, info.world, self.control_group)

    # -- logging, evaluation, stopping ----------------------------------------------------------
    def log(self, t: Trainer, **extra: Any) -> None:
        """One collective per log window: every rank's window (and its buffered telemetry) to every
        rank; all ranks build the same record, rank 0 writes it."""
        mine = t.window.take()
        if mine is None:  # the same on every rank: they count the same micro-batches
            return
        telemetry = self.rank_telemetry.take()
        everyone: list[Any] = [None] * self.info.world
        dist.all_gather_object(everyone, (mine, telemetry, t.timer.read()))
        windows = [e[0] for e in everyone]
        first = windows[0]["first_step"] or t.step
        rec = combine(windows, self._keys, **t.record_head(), **extra)
        rec["phase_ms"] = everyone[0][2]
        others = [r for _, records, _ in everyone[1:] for r in records] if self.info.is_main else []
        t.publish(rec, first, others)

    def stop(self, t: Trainer) -> None:
        """All ranks stop at the same step: the open window is logged whole, then rank 0 saves."""
        t._log()
        checkpointer.save_finite(t)

    def state_finite(self, t: Trainer) -> bool:
        """Every rank's window and parameters (fsdp: its shards) finite: one device read per rank, then
        a tiny all-reduce, so that either every rank saves or none does."""
        ok = checkpointer.finite_flag(t, torch.device("cpu")).to(torch.int32).reshape(1)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.control_group)
        return bool(ok.item())

    def evaluate(self, t: Trainer) -> None:
        """Each rank evaluates its slice of every validation batch; rank 0 writes the task's text sample."""
        if not t.loader.has_val:
            return
        info = self.info
        before = param_versions(self.rules.params)
        rec = evaluate_shards(
            t.model,
            t.task,
            t.loader.eval_shards(),
            info.device.kind,
            self.autocast_dtype,
            t._loss_weight,
            info.world,
            t.step,
        )
        check_param_writes(t.model, self.rules.params, before)
        if info.is_main:
            assert t.run_dir is not None
            write_sample(t.task, t.model, info.device.torch_device(), rec, t.run_dir)
        t.publish_eval(rec)

    # -- telemetry: each rank samples its own device; rank 0 writes every rank's records ---------
    def make_sampler(self, t: Trainer) -> TelemetrySampler | None:
        return self.rank_telemetry.make_sampler(t.config)

    def checkpoint_state(self, t: Trainer) -> dict[str, Any]:
        return checkpointer.checkpoint_state(t)

    def finish(self, t: Trainer, status: str) -> None:
        if status != "failed":
            with contextlib.suppress(Exception):
                self._drain_pending()

    def replay(self, t: Trainer) -> RankReplay:
        return RankReplay(t, self)


class RankReplay(LanesReplay):
    """The loop's side of a NaN's replay on a rank (every rank replays together, each its own shard): its
    own random streams, its loader of shards, its log window's part, the ranks' findings gathered."""

    spread: Ddp

    def __init__(self, t: Trainer, spread: Ddp) -> None:
        super().__init__(t, spread)
        self.lanes, self.window = 1, type(t.window)  # fsdp's reads the DTensor norm of its clipping

    def gather(self, obj: Any) -> list[Any]:
        everyone: list[Any] = [None] * self.spread.info.world
        dist.all_gather_object(everyone, obj, group=self.spread.control_group)
        return everyone

    def lane_rng(self) -> Any:
        return self.spread.streams.own()

    def set_lane_rng(self, state: Any) -> None:
        self.spread.streams.set_own(state)

    def replicas(self) -> list[torch.nn.Module]:
        return []

    def loader(self) -> Any:
        return self.spread.rank_loader(self.t)

    def run_step(self, step: int, tracer: Tracer) -> Any:
        t = self.t
        t.window = self.window()
        t.spread.train_step(t, self.accum)
        t.step = step
        return t.window.take()

    def record(self, windows: list[Any], step: int) -> dict[str, Any] | None:
        return combine(windows, self.lane_names, step=step) if all(w is not None for w in windows) else None
