"""The inner optimizer: AdamW (weight decay on matrices only) and its learning-rate schedule, linear warmup, then
cosine decay to ``lr * min_lr_ratio``.

The schedule is indexed by the peer's global inner step, so a resumed peer continues where it stopped.
Called by :class:`p2p_diloco.round.stage.Stage`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from p2p_diloco.config import InnerConfig


def inner_lr(step: int, cfg: InnerConfig, total_steps: int) -> float:
    """Learning rate of inner step ``step`` (0-based) of a schedule ``total_steps`` long."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine)


def make_inner_optimizer(named_params: list[tuple[str, nn.Parameter]], cfg: InnerConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (norm gains and other vectors are not decayed)."""
    decay = [p for _, p in named_params if p.dim() >= 2]
    no_decay = [p for _, p in named_params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             eps=cfg.eps)
