"""One rank's entry point: ``multilane train --strategy ddp`` inside torchrun or the elastic agent.

``rank_main`` carries torch's ``@record``: a rank that fails writes its error (message and traceback)
to the file the agent reads, so the launcher can say which rank failed and why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import sys
import time
from typing import TYPE_CHECKING, Any, NoReturn

import torch.distributed as dist
from multilane.engine.config import RunConfig
from multilane.engine.distributed import NODE_FILE_ENV, RUN_DIR_ENV, command_start
from multilane.engine.distributed.failures import LOST_PEER_ERROR, consolidate, write_note, write_refusal
from multilane.engine.distributed.rank import RankInfo, init_process_group
from multilane.engine.errors import UserError
from multilane.engine.run.control import RunControl
from torch.distributed.elastic.multiprocessing.errors import record

if TYPE_CHECKING:
    from multilane.engine.distributed.ddp import Ddp
    from multilane.engine.run.trainer import Trainer
    from multilane.engine.tasks import Task
    from multilane.engine.telemetry.devices import Device


class RankFailed(RuntimeError):
    """This rank's run failed; the message names the rank and its error."""


class RankLostPeers(RankFailed):
    """This rank failed because another rank vanished (its own error is secondary)."""


def probe_loop(config: RunConfig, task: Task, devices: list[Device]) -> Trainer:
    """The loop the fit probe drives in this process (engine/plan/probe.py): the lanes' (``Trainer.for_probe``),
    or a ddp or fsdp rank's, rank 0 of the probe's process group (ddp: this process alone; fsdp: torch's
    fake N ranks) on the first device, with no run folder, telemetry sampler or agreement between steps."""
    from multilane.engine.run.trainer import Trainer

    if config.devices.strategy not in ("ddp", "fsdp"):
        return Trainer.for_probe(config, task, devices)
    world = dist.get_world_size()
    info = RankInfo(0, world, 0, world, socket.gethostname(), devices[0])
    return Trainer.for_probe(config, task, devices, _strategy(config)(info))


def _strategy(config: RunConfig) -> type[Ddp]:
    from multilane.engine.distributed.ddp import Ddp
    from multilane.engine.distributed.fsdp_rank import Fsdp

    return Fsdp if config.devices.strategy == "fsdp" else Ddp


@record
def rank_main(config: RunConfig | None, resume_from: str | None, overrides: dict[str, Any]) -> int:
    from multilane.engine.display.progress import ProgressDisplay, summary
    from multilane.engine.run.trainer import Trainer

    if config is None:  # resuming: the devices come from the checkpoint's config
        from multilane.engine.config import build_config, merge
        from multilane.engine.rundir.runlog import RunDir

        ck = RunDir.open_existing(resume_from, lock=False, in_use_ok=True).load_checkpoint()  # rank 0 locks it
        config = build_config(merge(ck["config"], overrides), "resume config")
    info = RankInfo.from_env(config.devices.use)
    devices = config.devices
    init_process_group(info, devices.collective_timeout_s, devices.ddp_backend, devices.use, devices.fsdp_cpu_offload)
    requests = RunControl()

    def on_signal(signum: int, frame: Any) -> None:
        requests.request_stop()  # every time: the agent may repeat the signal; its SIGKILL comes later

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    progress = ProgressDisplay(started=command_start()) if info.is_main else None
    callbacks = [progress] if progress is not None else []
    spread = _strategy(config)
    if resume_from:
        strategy = spread(info, requests)
        trainer = Trainer(callbacks=callbacks, resume_from=resume_from, overrides=overrides, strategy=strategy)
    else:
        strategy = spread(info, requests, run_dir=os.environ.get(RUN_DIR_ENV))
        trainer = Trainer(callbacks=callbacks, config=config, strategy=strategy)
    result = trainer.run()
    if info.is_main:
        # A failure's message is the launcher's to say (the failure that caused the others, any rank's)
        said = (
            dataclasses.replace(result, message=None)
            if result.status == "failed" and NODE_FILE_ENV in os.environ
            else result
        )
        timing = progress.timing() if progress is not None else None
        print(summary(said, getattr(trainer, "total_steps", None), timing), flush=True)
    if result.status == "failed":
        message = f"rank {info.rank} ({info.key}): {result.message}"
        lost = bool(LOST_PEER_ERROR.search(result.message or ""))
        # The run folder knows every rank's failure (failures.py); a node that does not share the
        # folder (no shared filesystem) leaves the report to rank 0's.
        if trainer.run_dir is not None and trainer.run_dir.path.is_dir():
            with contextlib.suppress(OSError):
                write_note(trainer.run_dir.path, info.rank, message, result.traceback, lost, time.time())
                if info.is_main and NODE_FILE_ENV not in os.environ:  # bare torchrun: no launcher of ours
                    consolidate(trainer.run_dir.path, wait_for_cause_s=5.0 if lost else 0.0)
        raise (RankLostPeers if lost else RankFailed)(message)
    dist.destroy_process_group()
    return 0


def run_rank(config: RunConfig | None, resume_from: str | None, overrides: dict[str, Any]) -> NoReturn:
    """Run this rank and exit: 0; 1 when the run failed; 2 when this rank refused to run (bad input:
    ``UserError``, before the run began). Under our launcher the rank prints neither: the launcher
    says the failure (``failures.py``) or the refusal once. Under bare torchrun each rank says its
    refusal itself.

    The process ends with ``os._exit`` once everything is written (files are closed, the checkpoint
    fsynced, the error file recorded): at interpreter teardown a c10d background thread could still
    be joinable, and its destructor aborted the process now and then ("terminate called without an
    active exception", SIGABRT), which turned a finished rank into a failed one.
    """
    try:
        code = rank_main(config, resume_from, overrides)
    except RankFailed:
        code = 1
    except UserError as e:
        if not write_refusal(int(os.environ.get("RANK", "0")), str(e), bool(LOST_PEER_ERROR.search(str(e)))):
            print(f"multilane: error: {e}", file=sys.stderr)
        code = 2
    except Exception:
        if NODE_FILE_ENV not in os.environ:
            raise
        code = 1  # ``@record`` wrote it (message and traceback) for the launcher, which reports it
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
