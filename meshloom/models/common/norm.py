"""RMSNorm, the normalisation every family uses, and its zero-centred variant (Qwen3-Next)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 for stability under bf16."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)


class ZeroCentredRMSNorm(nn.Module):
    """RMSNorm whose gain is stored as an offset from one (scale = 1 + weight), so weight decay pulls the gain towards
    one rather than zero; the product is taken in float32 before casting back."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)

    def init_weights(self) -> None:
        nn.init.zeros_(self.weight)
