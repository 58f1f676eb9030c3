"""The optimizer of `topkd train`: AdamW without decay on norms and biases, linear warmup then cosine.

optimizer, scheduler = make_optimizer(module, cfg)
"""

from __future__ import annotations

import math

import torch

from topkd.train.config import TrainConfig


def make_optimizer(module: torch.nn.Module, cfg: TrainConfig):
    """AdamW over param_groups, stepped by a LambdaLR of lr_factor (one scheduler step per optimizer step)."""
    optimizer = torch.optim.AdamW(param_groups(module, cfg.weight_decay), lr=cfg.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg))
    return optimizer, scheduler


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to 1, then cosine to min_lr_ratio at the last step."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only; norms, biases and other vectors are not decayed."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
