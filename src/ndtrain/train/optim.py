"""AdamW with decoupled weight decay on matrices only, and warmup + cosine learning rate."""

from __future__ import annotations

import math

import torch
from torch import nn


def build_optimizer(model_parts: list[nn.Module], cfg) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for p in (p for part in model_parts for p in part.parameters()):
        if p.requires_grad:
            # Norm gains (1-D) are not decayed: shrinking them only fights the normalisation.
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    impl = {"foreach": dict(foreach=True), "fused": dict(fused=True), "for-loop": dict(foreach=False)}[cfg.implementation]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, **impl)


def lr_at(step: int, cfg, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    decay_steps = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
