"""Qwen3-Next's full-attention layer: grouped-query attention with a sigmoid output gate per head, zero-centred
QK-norm and partial rotary embeddings.

``wq`` projects each head's query and its gate side by side ([q_h, gate_h] per head, as the released checkpoints
store them), so a column split over tensor-parallel ranks keeps each head's gate with it. ``core`` may be swapped
from outside (context parallel puts its ring there) and gets ``document_ids``; ``kv_cache`` is set from outside while
generating (meshloom.inference.kv_cache), as for the shared attention of meshloom.models.common.attention.
"""

from __future__ import annotations

import torch
from torch import nn

from meshloom.models.common.attention import causal_attention, masked_attention, rotate
from meshloom.models.common.init import trunc_normal_
from meshloom.models.common.norm import ZeroCentredRMSNorm
from meshloom.models.common.rope import apply_rope_half_partial


class GatedAttention(nn.Module):
    """Causal GQA whose output is scaled per channel by sigmoid(gate) before the output projection."""

    # Distinguishes the block's token mixers: this one keeps keys and values, a GatedDeltaNet a recurrent state.
    recurrent = False

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, norm_eps: float):
        super().__init__()
        self.head_dim = head_dim
        self.wq = nn.Linear(dim, n_heads * head_dim * 2, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)
        self.q_norm = ZeroCentredRMSNorm(head_dim, norm_eps)
        self.k_norm = ZeroCentredRMSNorm(head_dim, norm_eps)
        # Swappable from outside (context parallel puts a ring over the sequence shards here).
        self.core = causal_attention
        # Set only while generating (meshloom.inference.kv_cache.KVCache installs and removes it).
        self.kv_cache = None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, document_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        b, s, _ = x.shape
        if cos.dim() == 2:  # cut here, where the sequence is whole (see common/attention.py)
            cos, sin = cos[:s], sin[:s]
        # -1 heads: under tensor parallel each rank sees only its local heads.
        q, gate = self.wq(x).view(b, s, -1, 2 * self.head_dim).chunk(2, dim=-1)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k = self.q_norm(q), self.k_norm(k)
        q = rotate(apply_rope_half_partial, q, cos, sin).transpose(1, 2)
        k = rotate(apply_rope_half_partial, k, cos, sin).transpose(1, 2)
        v = v.transpose(1, 2)
        mask = None
        if self.kv_cache is not None:
            k, v, mask = self.kv_cache.update(k, v)
        n_rep = q.shape[1] // k.shape[1]
        # A core that takes grouped keys and values (ring attention) expands them itself.
        if n_rep > 1 and not (getattr(self.core, "grouped_kv", False) and mask is None):
            k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
        out = self.core(q, k, v, document_ids) if mask is None else masked_attention(q, k, v, mask)
        out = out.transpose(1, 2).reshape(b, s, -1) * torch.sigmoid(gate.reshape(b, s, -1))
        return self.wo(out)

    def init_weights(self, std: float, out_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            trunc_normal_(linear.weight, std)
        trunc_normal_(self.wo.weight, out_std)
        self.q_norm.init_weights()
        self.k_norm.init_weights()
