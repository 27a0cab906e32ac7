"""Health of an outside loop's model sharded over the ranks by FSDP2 (``fully_shard``, as Lightning's
``ModelParallelStrategy`` applies it in ``configure_model``), on the engine's own fsdp support.

Each parameter is a ``DTensor``: every rank holds its shard and its shard of the gradient FSDP has
averaged over the ranks. The engine's monitor with ``sharded=True`` (engine/health/monitor.py, as
the engine's fsdp strategy uses it) sums each rank's local squares (``to_local()``: FSDP2's padding
excluded) and activation sums over the ranks at log time: the whole layer's values, exactly.

The noise scale needs each rank's own gradient before FSDP combines them: FSDP2's reduce-scatter is
handed this rank's whole (padded) gradient of a module's parameters, once per module in a backward,
and the engine's ``fsdp_reduce_scatter`` reads its squares first. An outside loop may reduce-scatter
at every micro-batch (Lightning keeps ``no_sync`` for DDP): then the rank's gradient of the whole step
never exists unsharded, and the noise scale is measured only with one micro-batch per step.
"""

from __future__ import annotations

from multilane.engine.health.lane_grads import LaneGradProbe
from torch import nn

OURS = ("DefaultReduceScatter", "ProbeReduceScatter")  # torch's own, or an earlier run's probe


def is_sharded(model: nn.Module) -> bool:
    """Some parameter of ``model`` is a ``DTensor`` (FSDP2, tensor parallelism)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def probe_reduce_scatter(model: nn.Module, probe: LaneGradProbe, rank: int, world: int) -> str | None:
    """Every FSDP2 module of ``model`` reduce-scatters through the engine's probing one; None, or why
    not (a model without FSDP2 modules, one whose FSDP reduce-scatters through a comm of the user's
    own, which stays theirs, a torch without the hook)."""
    from torch.distributed.fsdp import FSDPModule

    fsdp = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not fsdp:
        return "no module is FSDP2's (fully_shard)"
    for m in fsdp:
        try:
            groups = m._get_fsdp_state()._fsdp_param_groups
        except AttributeError:  # another torch's internals: nothing to tell
            break
        for g in groups:
            comm = getattr(g, "_reduce_scatter_comm", None)
            if comm is not None and type(comm).__name__ not in OURS:
                return f"the model's FSDP already reduce-scatters through its own {type(comm).__name__}"
    from multilane.engine.health.lane_grads import fsdp_reduce_scatter

    try:
        comm = fsdp_reduce_scatter(probe, rank, world)
        for m in fsdp:
            m.set_custom_reduce_scatter(comm)
    except (ImportError, ValueError, RuntimeError) as e:
        return str(e).splitlines()[0] if str(e) else type(e).__name__
    return None
