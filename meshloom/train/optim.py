"""AdamW with decay on weight matrices only."""

from __future__ import annotations

import torch
from torch import nn

from meshloom.config.schema import OptimizerConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Matrices (projections, embeddings) decay; vectors (norm scales, biases) do not."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, config: OptimizerConfig, device: torch.device) -> torch.optim.Optimizer:
    implementation = config.implementation
    if implementation == "auto":
        implementation = "fused" if device.type == "cuda" else "foreach"
    return torch.optim.AdamW(
        param_groups(model, config.weight_decay),
        lr=config.lr,
        betas=(config.beta1, config.beta2),
        eps=config.eps,
        fused=implementation == "fused",
        foreach=implementation == "foreach",
    )
