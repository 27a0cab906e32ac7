"""Optimizers and learning-rate schedules, from the config."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from multilane.engine.config import OptimSection, ScheduleSection


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimSection) -> torch.optim.Optimizer:
    params = list(params)
    if cfg.name == "sgd":
        return torch.optim.SGD(
            params, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov, weight_decay=cfg.weight_decay
        )
    betas = (cfg.beta1, cfg.beta2)
    if cfg.name == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, betas=betas, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, betas=betas, weight_decay=cfg.weight_decay)


def lr_at(step: int, total_steps: int, base_lr: float, cfg: ScheduleSection) -> float:
    """The learning rate for optimizer step ``step`` (0-based) of ``total_steps``.

    A pure function of the step, so a resumed run needs no scheduler state.
    """
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return base_lr * (step + 1) / cfg.warmup_steps
    if cfg.kind == "constant":
        return base_lr
    if cfg.kind == "step":
        return base_lr * cfg.gamma ** ((step - cfg.warmup_steps) // cfg.step_size)
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = base_lr * cfg.min_lr_ratio
    return floor + (base_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
