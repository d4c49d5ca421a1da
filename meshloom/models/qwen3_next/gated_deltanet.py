"""Qwen3-Next's linear-attention layer: Gated DeltaNet.

Per token: q, k, v from separate projections pass a short causal depthwise convolution and SiLU; q and k are
L2-normalised per head; each value head decays its state by exp(g) with g = -exp(A_log) * softplus(a + dt_bias) and
writes with strength beta = sigmoid(b) (the gated delta rule, meshloom.models.common.gated_delta); the output is
RMS-normalised per head and gated by silu(z) before the output projection. A key head serves n_value_heads /
n_key_heads consecutive value heads.

The projections are separate linears, and every per-head parameter (the convolution filters of q, k and v, A_log,
dt_bias) is laid out head by head along dim 0, so tensor parallel gives each rank whole key heads with their value
heads (the Hugging Face adapter splits the released fused, per-key-head-grouped projections).

Training calls the convolution and the rule only through ``self.core`` (context parallel swaps in a version that
passes the state and the convolution history between sequence shards). While generating, ``kv_cache`` (set from
outside, meshloom.inference.kv_cache) holds the recurrent state and the last inputs of the convolution instead.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from meshloom.models.common.gated_delta import LOCAL_CORE
from meshloom.models.common.init import trunc_normal_
from meshloom.models.common.norm import RMSNorm
from meshloom.tensors import local_tensor


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in float32."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).type_as(x)


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet over x [b, s, dim] (see the module docstring)."""

    # Distinguishes the block's token mixers: this one keeps a recurrent state, GatedAttention keys and values.
    recurrent = True

    def __init__(
        self, dim: int, n_key_heads: int, n_value_heads: int, key_head_dim: int, value_head_dim: int, conv_kernel: int, norm_eps: float
    ):
        super().__init__()
        self.key_head_dim, self.value_head_dim = key_head_dim, value_head_dim
        key_dim, value_dim = n_key_heads * key_head_dim, n_value_heads * value_head_dim
        self.wq = nn.Linear(dim, key_dim, bias=False)
        self.wk = nn.Linear(dim, key_dim, bias=False)
        self.wv = nn.Linear(dim, value_dim, bias=False)
        self.wz = nn.Linear(dim, value_dim, bias=False)
        self.wb = nn.Linear(dim, n_value_heads, bias=False)
        self.wa = nn.Linear(dim, n_value_heads, bias=False)
        # Depthwise filters [channels, kernel]; weight[:, -1] multiplies the token itself.
        self.q_conv = nn.Parameter(torch.empty(key_dim, conv_kernel))
        self.k_conv = nn.Parameter(torch.empty(key_dim, conv_kernel))
        self.v_conv = nn.Parameter(torch.empty(value_dim, conv_kernel))
        self.A_log = nn.Parameter(torch.empty(n_value_heads))
        self.dt_bias = nn.Parameter(torch.empty(n_value_heads))
        self.norm = RMSNorm(value_head_dim, norm_eps)
        self.wo = nn.Linear(value_dim, dim, bias=False)
        # Swappable from outside (context parallel passes state between sequence shards).
        self.core = LOCAL_CORE
        # Set only while generating (meshloom.inference.kv_cache.KVCache installs and removes it).
        self.kv_cache = None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, document_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """cos/sin are unused (no positions: the recurrence orders the tokens); taken so both mixers share a call."""
        b, s, _ = x.shape
        cache = self.kv_cache
        if cache is not None:
            # Padding positions get zero input, so they leave the state and the convolution history at zero.
            x = x * cache.real_tokens(s).unsqueeze(-1).to(x.dtype)
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        widths = [q.shape[-1], k.shape[-1], v.shape[-1]]
        mixed = torch.cat([q, k, v], dim=-1)
        filters = torch.cat([local_tensor(w) for w in (self.q_conv, self.k_conv, self.v_conv)])
        mixed = self.core.conv(mixed, filters, document_ids=document_ids) if cache is None else cache.conv(mixed, filters)
        q, k, v = F.silu(mixed).split(widths, dim=-1)
        # -1 heads: under tensor parallel each rank sees only its local heads.
        q = l2_normalize(q.view(b, s, -1, self.key_head_dim))
        k = l2_normalize(k.view(b, s, -1, self.key_head_dim))
        v = v.view(b, s, -1, self.value_head_dim)
        n_rep = v.shape[2] // k.shape[2]
        q, k = q.repeat_interleave(n_rep, dim=2), k.repeat_interleave(n_rep, dim=2)
        beta = torch.sigmoid(self.wb(x))
        # float32: exp(A_log) times the softplus would lose the small decays in bf16.
        g = -local_tensor(self.A_log).float().exp() * F.softplus(self.wa(x).float() + local_tensor(self.dt_bias).float())
        scale = self.key_head_dim**-0.5
        if cache is None:
            out = self.core.rule(q, k, v, g, beta, scale, document_ids=document_ids)
        else:
            out = cache.rule(q, k, v, g, beta, scale)
        z = self.wz(x).view(b, s, -1, self.value_head_dim)
        out = (self.norm(out.to(x.dtype)).float() * F.silu(z.float())).to(x.dtype)
        return self.wo(out.reshape(b, s, -1))

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv, self.wz, self.wb, self.wa):
            trunc_normal_(linear.weight, std)
        trunc_normal_(self.wo.weight, out_std)
        # As nn.Conv1d initialises a depthwise filter: uniform within 1/sqrt(kernel).
        bound = 1.0 / math.sqrt(self.q_conv.shape[-1])
        for conv in (self.q_conv, self.k_conv, self.v_conv):
            nn.init.uniform_(conv, -bound, bound)
        # Gated DeltaNet's initialisation: A uniform in [1, 16] and step sizes log-uniform in [1e-3, 1e-1] (dt_bias the
        # inverse softplus of the step), so each head starts with its own memory length, none of them instant.
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1.0, 16.0).log())
        dt = torch.exp(torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(1e-1))).clamp(min=1e-4)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        self.norm.init_weights()
