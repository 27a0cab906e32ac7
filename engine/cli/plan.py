"""``multilane plan`` (and ``train --dry-run``): the memory a run will need on each device, without training."""

from __future__ import annotations

import argparse
import json
import sys

from multilane.engine.errors import UserError


def cmd_plan(args: argparse.Namespace) -> int:
    """Print the forecast (a table, or JSON with ``--json``); exit 2 with one line when it will not fit."""
    from multilane.engine.cli.train import _overrides, _run_config

    overrides = _overrides(args)
    if args.task is not None and overrides.get("task.params") == {}:
        del overrides["task.params"]
    config = _run_config(args, overrides)
    from multilane.engine.distributed.worker import probe_loop
    from multilane.engine.plan.fit import plan_run
    from multilane.engine.run.failures import one_line, where
    from multilane.engine.run.run_spec import resolve_run

    spec = resolve_run(config, {}, None, None)
    try:
        forecast = plan_run(spec.config, spec.task, spec.devices, probe_loop)
    except (UserError, KeyboardInterrupt):
        raise
    except (Exception, SystemExit) as e:
        raise UserError(f"task {spec.task.name}: setup failed{where(e)}: {one_line(e)}") from None
    if getattr(args, "json", False):
        print(json.dumps(forecast.to_dict()))
    else:
        print("\n".join(forecast.table()))
    refusal = forecast.refusal()
    if refusal:
        print(f"multilane: error: {refusal}", file=sys.stderr)
        return 2
    return 0
