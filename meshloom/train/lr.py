"""Learning-rate schedules: linear warm-up, then linear, cosine or warmup-stable-decay."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from meshloom.config.schema import LRSchedulerConfig


def lr_factor(step: int, total_steps: int, config: LRSchedulerConfig) -> float:
    """Multiplier of the peak learning rate for the update made at `step` (0-based)."""
    warmup = min(config.warmup_steps, total_steps)
    if step < warmup:
        # Start at 1/(warmup+1) rather than 0 so the first update is not wasted.
        return (step + 1) / (warmup + 1)
    floor = config.min_lr_ratio
    if config.decay_type == "wsd":
        decay_steps = max(1, round(config.decay_ratio * total_steps))
        decay_start = max(warmup, total_steps - decay_steps)
        if step < decay_start:
            return 1.0
        progress = (step - decay_start) / max(1, total_steps - decay_start)
        return 1.0 - (1.0 - floor) * progress
    progress = (step - warmup) / max(1, total_steps - warmup)
    if config.decay_type == "linear":
        return 1.0 - (1.0 - floor) * progress
    assert config.decay_type == "cosine", config.decay_type
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_lr_scheduler(optimizer: torch.optim.Optimizer, config: LRSchedulerConfig, total_steps: int) -> LambdaLR:
    return LambdaLR(optimizer, lambda step: lr_factor(step, total_steps, config))
