"""Will it fit: the probe's lines at the run's batch, against each memory's free bytes; the check
a run makes before anything starts (``train.fit_check``)."""

from __future__ import annotations

import os
from typing import Any

import torch
from multilane.engine.config import RunConfig
from multilane.engine.distributed.rank_state import InplaceWriteError
from multilane.engine.errors import UserError, one_line, where
from multilane.engine.plan.forecast import USABLE, Forecast, Need, largest_batch, needs_at, per_rank_at
from multilane.engine.plan.measure import free_bytes
from multilane.engine.plan.probe import MemoryLine, _kept_random_state, probe
from multilane.engine.tasks import Task
from multilane.engine.telemetry.devices import Device

FIT_CHECK_ENV = "MULTILANE_FIT_CHECK"
"""Set to 0 to skip the check everywhere (the test suite does, but for the tests of the check itself)."""


def fit_check_on(config: RunConfig) -> bool:
    """Whether a run checks its fit: ``train.fit_check``, not turned off by the environment, and not a
    ddp rank (its launcher checked, once for every rank)."""
    from multilane.engine.distributed import in_worker

    return config.train.fit_check and os.environ.get(FIT_CHECK_ENV, "1") != "0" and not in_worker()


def plan_run(config: RunConfig, task: Task, devices: list[Device], loop: Any) -> Forecast:
    """Probe the run (probe.py; ``loop``: the loop whose strategy's step the probe drives)
    and forecast every memory's peak at its batch (one line if the probe itself runs out of memory)."""
    try:
        lines = probe(config, task, devices, loop)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        raise UserError(
            f"will not fit: the probe ran out of GPU memory with a few samples per device "
            f"(strategy {config.devices.strategy}, precision {config.train.precision})"
        ) from None
    except (UserError, KeyboardInterrupt):
        raise
    except InplaceWriteError as e:  # the ddp rank's own refusal, before any rank starts
        raise UserError(str(e)) from None
    except (Exception, SystemExit) as e:
        raise _failed_step(config, task, e) from None
    return forecast_from(lines, config, len(devices))


def _failed_step(config: RunConfig, task: Task, e: BaseException) -> UserError:
    """One line for a step of the check that failed: its steps are the run's own (probe.py, reach.py), so
    the run's first step would fail the same way."""
    return UserError(
        f"task {task.name}: the fit check's probe step failed{where(e)}: {one_line(e)} "
        f"(strategy {config.devices.strategy}; train.fit_check = false skips the check)"
    )


def check_reach(config: RunConfig, task: Task, devices: list[Device]) -> None:
    """fsdp on several devices: ``UserError`` for a layer only some ranks' shards reach (engine/fsdp/reach.py),
    whose collectives would differ between the ranks; each rank's shard of the run's first micro-batches."""
    if config.devices.strategy != "fsdp" or len(devices) < 2:
        return
    from multilane.engine.fsdp.reach import check_shards
    from multilane.engine.fsdp.units import choose_units

    try:
        with _kept_random_state(devices):  # the run draws what it would have drawn
            check_shards(config, task, lambda m: choose_units(task, m), len(devices), devices[0].torch_device())
    except (UserError, KeyboardInterrupt):
        raise
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        raise UserError(
            "will not fit: one rank's shard of the batch ran out of GPU memory in the whole model (strategy fsdp)"
        ) from None
    except (Exception, SystemExit) as e:
        raise _failed_step(config, task, e) from None
    finally:
        if devices[0].is_cuda:
            torch.cuda.empty_cache()


def forecast_from(lines: list[MemoryLine], config: RunConfig, n: int) -> Forecast:
    weights = config.devices.weights or None
    batch = min([config.data.batch_size, *[x.data_batch for x in lines if x.data_batch]])
    free = [free_bytes(line.name) for line in lines]
    needs = []
    for line, b, f in zip(lines, needs_at(lines, batch, n, weights), free, strict=True):
        per_rank = per_rank_at(line, batch, n, weights) if line.ranks > 1 else None
        needs.append(Need(line.name, b, f, line.ranks, per_rank, line.shards))

    def fits(b: int) -> bool:
        return all(f is None or x <= USABLE * f for x, f in zip(needs_at(lines, b, n, weights), free, strict=True))

    return Forecast(
        batch,
        n,
        config.devices.strategy,
        needs,
        largest_batch(fits, n),
        [vars(line) for line in lines],
    )


def check_fit(config: RunConfig, task: Task, devices: list[Device], loop: Any) -> Forecast | None:
    """The forecast, or ``UserError`` with one line when the run will not fit; None when the check is off."""
    if not fit_check_on(config):
        return None
    forecast = plan_run(config, task, devices, loop)
    refusal = forecast.refusal()
    if refusal:
        raise UserError(refusal)
    check_reach(config, task, devices)  # once it is known to fit: each shard in the whole model
    return forecast
