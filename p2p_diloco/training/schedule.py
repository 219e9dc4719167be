"""The inner learning-rate schedule: linear warmup, then cosine decay to ``lr * min_lr_ratio``.

Indexed by the peer's global inner step, so a resumed peer continues where it stopped.
Called by :class:`p2p_diloco.training.stage.Stage`.
"""

from __future__ import annotations

import math

from p2p_diloco.config import InnerConfig


def inner_lr(step: int, cfg: InnerConfig, total_steps: int) -> float:
    """Learning rate of inner step ``step`` (0-based) of a schedule ``total_steps`` long."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine)
