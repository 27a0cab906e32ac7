"""Which modules of a model become FSDP units, and sharding the model with ``fully_shard``.

The rule (docs/fsdp.md): walking down from the model, a child that is a container (``nn.Sequential``,
``nn.ModuleList``, ``nn.ModuleDict``) or that holds a stack of blocks (a ``ModuleList`` or
``ModuleDict`` among its own children, as a transformer's ``layers``) is opened and its children are
looked at the same way; any other child that holds parameters becomes a unit, unless one of its
parameters is also used by a module outside it (tied weights: such a child stays in the root's unit,
which must all-gather the shared tensor once). The root is sharded last and holds whatever is left. A task chooses its own units with
``fsdp_units(model) -> list[nn.Module]``.

Each unit's parameters are all-gathered just before its forward and freed after it (and again around
its backward), so a device holds one unit's full parameters at a time, plus its shards of everything.
Options (``devices.fsdp_activation_checkpointing``, ``devices.fsdp_cpu_offload``): each unit's forward
recomputed in backward (``recomputed``), the shards kept in host memory (``offload_policy``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from multilane.engine.errors import UserError
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def _owners(model: nn.Module) -> dict[int, set[int]]:
    """For each parameter (by id), the ids of the modules that hold it directly."""
    out: dict[int, set[int]] = {}
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None:
                out.setdefault(id(p), set()).add(id(m))
    return out


def _self_contained(module: nn.Module, owners: dict[int, set[int]]) -> bool:
    inside = {id(m) for m in module.modules()}
    params = list(module.parameters())
    return bool(params) and all(owners[id(p)] <= inside for p in params)


def default_units(model: nn.Module) -> list[nn.Module]:
    """The modules that become units by the rule in the module docstring (the root not included)."""
    owners = _owners(model)

    def walk(parent: nn.Module) -> Iterator[nn.Module]:
        for child in parent.children():
            stack = any(isinstance(c, (nn.ModuleList, nn.ModuleDict)) for c in child.children())
            if isinstance(child, CONTAINERS) or stack:
                yield from walk(child)
            elif _self_contained(child, owners):
                yield child

    return list(walk(model))


def choose_units(task: Any, model: nn.Module) -> list[nn.Module]:
    """The task's ``fsdp_units(model)`` if it defines one (checked), else ``default_units``."""
    hook = getattr(task, "fsdp_units", None)
    if hook is None:
        return default_units(model)
    units = list(hook(model))
    inside = {id(m) for m in model.modules()}
    for u in units:
        if not isinstance(u, nn.Module) or id(u) not in inside or u is model:
            raise UserError(
                f"task {getattr(task, 'name', '?')}: fsdp_units must return submodules of the model "
                f"(not the model itself), got {type(u).__name__}"
            )
    return units


MIXED_TENSORS = "got mixed torch.Tensor and DTensor"
"""torch's words when an op meets a gathered (plain) parameter and a sharded one (a DTensor)."""

READS_PARAMETERS = (
    "devices.strategy = fsdp: the model's forward computes with parameters outside the unit that is "
    "computing (as a penalty over self.parameters() in forward does), which FSDP holds sharded there: use "
    'devices.strategy = "ddp", "replicate" or "persistent", or give the task fsdp_units(model) returning [] '
    "(the whole model one unit, gathered for each forward)"
)


@contextlib.contextmanager
def parameters_read_in_forward() -> Iterator[None]:
    """A forward inside: torch's "mixed torch.Tensor and DTensor" error becomes one line (``UserError``)
    naming the model feature that causes it and what trains it."""
    try:
        yield
    except RuntimeError as e:
        if MIXED_TENSORS not in str(e):
            raise
        raise UserError(READS_PARAMETERS) from None


VIEW_WARNING = r"FSDP2-wrapped module \(.*\) returned a view tensor\. An in-place op on this view"
"""FSDP2's warning at every forward of a unit that returns a view (a ``Linear`` on a 3-d input, a
``.view()`` of logits): torch cannot know whether the caller changes that view in place, which would
drop the unit's pre-backward hook. ``ViewOutputs`` checks exactly that on every forward, so the warning
is filtered (``quiet_view_warning``) and a model that does it is refused in one line instead."""


def quiet_view_warning() -> None:
    """Filter FSDP2's view-output warning, by its exact words, category and module (once per process)."""
    import warnings

    warnings.filterwarnings(
        "ignore", message=VIEW_WARNING, category=UserWarning, module=r"torch\.distributed\.fsdp\._fully_shard"
    )


class ViewOutputs:
    """The view outputs of the FSDP units in each forward, with their version counters: ``check`` (after
    the forward and the loss, before backward) refuses a model that changed one in place."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self._seen: list[tuple[str, torch.Tensor, int]] = []
        self._handles = [m.register_forward_hook(self._hook) for m in modules]

    def _hook(self, module: nn.Module, _args: Any, output: Any) -> None:
        if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
            return  # evaluation, or a forward recomputed in backward
        from torch.utils._pytree import tree_leaves

        for t in tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad and t._base is not None:
                self._seen.append((type(module).__name__.removeprefix("FSDP"), t, t._version))

    def check(self) -> None:
        seen, self._seen = self._seen, []
        for kind, t, version in seen:
            if t._version != version:
                raise UserError(
                    f"devices.strategy = fsdp: the model changes the output of an FSDP unit ({kind}, a view) in "
                    "place, which skips the unit's gathering for backward (wrong gradients): use an out-of-place "
                    '`out = out + y` or `.clone()` it first, or devices.strategy = "ddp"'
                )

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def mixed_precision(precision: str) -> Any:
    """FSDP2's ``MixedPrecisionPolicy`` for ``train.precision``: bf16 computes with bf16 copies of the
    parameters (all-gathered in bf16: half the traffic), reduces gradients in float32 and hands the
    root's outputs to the loss in float32; fp32 keeps every tensor as it is."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "fp32":
        return MixedPrecisionPolicy()
    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    raise UserError(
        f"train.precision = {precision} with devices.strategy = fsdp: use bf16 (FSDP2's mixed precision; "
        "fp16's loss scaling over sharded gradients is not supported here) or fp32"
    )


def recomputed(units: list[nn.Module]) -> list[nn.Module]:
    """The units activation checkpointing recomputes: every unit but those holding BatchNorm, whose
    running statistics a recompute in backward would update a second time."""
    return [u for u in units if not any(isinstance(m, _BatchNorm) for m in u.modules())]


def offload_policy(cpu_offload: bool, device: torch.device) -> Any:
    """FSDP2's offload policy: ``CPUOffloadPolicy`` keeps the shards (parameters, gradients, optimizer
    state) in host memory. Its default pins them, which needs an accelerator: torch refuses it on CPU
    lanes ("Cannot access accelerator device when none is available"), where the shards already live in
    host memory, so there they are not pinned and the policy moves nothing."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if not cpu_offload:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=device.type != "cpu")


def shard_model(
    model: nn.Module,
    units: list[nn.Module],
    precision: str,
    mesh: Any = None,
    *,
    activation_checkpointing: bool = False,
    cpu_offload: bool = False,
    device: torch.device | None = None,
) -> list[nn.Module]:
    """``fully_shard`` each unit, then the root, in place; returns the units. ``activation_checkpointing``:
    torch's composable ``checkpoint`` on each unit of ``recomputed(units)`` first (non-reentrant; it keeps
    the modules and their parameter names, so state dicts and checkpoints are unchanged); ``cpu_offload``:
    ``offload_policy`` on every unit and the root."""
    from torch.distributed._composable import checkpoint
    from torch.distributed.fsdp import fully_shard

    mp = mixed_precision(precision)
    root_mp = mp
    if mp.param_dtype is not None:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        root_mp = MixedPrecisionPolicy(mp.param_dtype, mp.reduce_dtype, output_dtype=torch.float32)
    kwargs = {"mesh": mesh} if mesh is not None else {}
    kwargs["offload_policy"] = offload_policy(cpu_offload, device or torch.device("cpu"))
    if activation_checkpointing:
        for u in recomputed(units):
            checkpoint(u)
    quiet_view_warning()  # accounted for: ViewOutputs (above)
    for u in units:
        fully_shard(u, mp_policy=mp, **kwargs)
    fully_shard(model, mp_policy=root_mp, **kwargs)
    return units
