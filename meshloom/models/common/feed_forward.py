"""The SwiGLU MLP of every dense block (and of each expert, stacked, in the MoE layer)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshloom.models.common.init import trunc_normal_


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, std: float, out_std: float) -> None:
        trunc_normal_(self.w1.weight, std)
        trunc_normal_(self.w3.weight, std)
        trunc_normal_(self.w2.weight, out_std)
