"""Model features a strategy (or the optimizer) cannot train exactly, found before step 1.

Each is refused in one line naming the feature, where it is in the model, and a strategy that trains
it (docs/fsdp.md, docs/design.md):

- **sparse gradients** (``Embedding``/``EmbeddingBag`` with ``sparse=True``): torch's Adam and AdamW
  refuse them (on one device too); FSDP cannot shard them (its reduce-scatter is dense); under ddp such
  a weight tied to a dense layer gets a dense gradient where DDP's reducer expects a sparse one;
- **a 0-dim parameter** (``nn.Parameter(torch.tensor(1.0))``): FSDP shards every parameter on dim 0;
- **a forward that renormalises a parameter in place** (``Embedding(max_norm=...)``): each ddp rank
  would change the rows its own shard looks up, and under fsdp the change is made to the gathered
  copy and lost when it is freed; replicate and persistent merge such writes across lanes.
"""

from __future__ import annotations

from typing import Any

import torch
from multilane.engine.errors import UserError
from multilane.engine.tensors.grads import sparse_grad_modules
from torch import nn

LANE_STRATEGIES = 'devices.strategy = "replicate" or "persistent"'


def _tied_sparse(model: nn.Module) -> list[str]:
    """Sparse-gradient modules whose weight another module also holds (tied weights)."""
    holders: dict[int, list[str]] = {}
    for name, m in model.named_modules():
        for p in m._parameters.values():
            if p is not None:
                holders.setdefault(id(p), []).append(name or "the model")
    out = []
    for name, m in model.named_modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and getattr(m, "sparse", False):
            others = [h for h in holders.get(id(m.weight), []) if h != (name or "the model")]
            if others:
                out.append(f"{name or 'the model'} (Embedding(sparse=True), its weight tied to {others[0]})")
    return out


def _in_place_writers(model: nn.Module) -> list[str]:
    return [
        f"{name or 'the model'} ({type(m).__name__}(max_norm={m.max_norm:g}))"
        for name, m in model.named_modules()
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.max_norm is not None
    ]


def refusal(model: nn.Module, strategy: str, optimizer: str) -> str | None:
    """One line if ``model`` has a feature ``strategy`` (or ``optimizer``) cannot train, else None."""
    sparse = sparse_grad_modules(model)
    if sparse and optimizer in ("adam", "adamw"):
        return (
            f"the model's {sparse[0]} makes sparse gradients, which optim.name = {optimizer} does not take "
            "(torch's Adam and AdamW refuse them): use optim.name = sgd, or sparse=False"
        )
    if strategy == "fsdp":
        if sparse:
            return (
                f"devices.strategy = fsdp: the model's {sparse[0]} makes sparse gradients, which FSDP cannot "
                'shard: use devices.strategy = "ddp", "replicate" or "persistent", or sparse=False'
            )
        if zero_dim := [f"'{n}'" for n, p in model.named_parameters() if p.dim() == 0]:
            return (
                f"devices.strategy = fsdp: parameter {zero_dim[0]} is 0-dim (a scalar), which FSDP cannot shard "
                'on dim 0: use devices.strategy = "ddp" (or any other), or give it shape (1,)'
            )
    if strategy in ("ddp", "fsdp") and (writers := _in_place_writers(model)):
        lost = (
            "each ddp process would make for its own shard only"
            if strategy == "ddp"
            else "fsdp would make to a gathered copy and lose when it is freed"
        )
        return (
            f"devices.strategy = {strategy}: the model's {writers[0]} changes its weight in place during the "
            f"forward, which {lost}: use {LANE_STRATEGIES}, whose lanes merge such changes"
        )
    if strategy == "ddp" and (tied := _tied_sparse(model)):
        return (
            f"devices.strategy = ddp: the model's {tied[0]} gets a dense gradient where DDP expects a sparse "
            f"one: use {LANE_STRATEGIES}, or sparse=False"
        )
    return None


def check(config: Any, task: Any) -> None:
    """``UserError`` (one line) if the task's model has a feature the run's strategy or optimizer cannot
    train: before anything starts (the fit check's probe, a folder, a rank). The model is built on the
    meta device (no memory, no values); a task whose model cannot be built there is checked on the real
    model at set-up (``refusal``), still before step 1."""
    torch.manual_seed(config.train.seed)
    try:
        with torch.device("meta"):
            model = task.build_model()
    except Exception:
        return
    check_model(model, config)


def check_model(model: nn.Module, config: Any) -> None:
    """``UserError`` (one line) if ``model`` has a feature the run's strategy or optimizer cannot train."""
    refused = refusal(model, config.devices.strategy, config.optim.name)
    if refused:
        raise UserError(refused)
