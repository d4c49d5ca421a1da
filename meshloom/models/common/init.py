"""Weight initialisation helpers shared by the families."""

from __future__ import annotations

import torch
from torch import nn


def trunc_normal_(weight: torch.Tensor, std: float) -> None:
    """Normal init cut at 3 std, so no single weight starts as an outlier."""
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std)
