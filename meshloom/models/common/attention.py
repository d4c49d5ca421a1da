"""Causal self-attention: the swappable attention core and grouped-query attention.

Attention derives the local head count from tensor shapes (``view(b, s, -1, head_dim)``), so column-sharded
projections work unchanged under tensor parallel. ``core`` may be replaced from outside (context parallel puts
a ring over the sequence shards there).

Inference: ``kv_cache`` (None while training) may be set from outside to an object with
``update(k, v) -> (k_all, v_all, mask)`` (see ``meshloom.inference.kv_cache``): it stores this step's keys and
values [b, kv_heads, s, head_dim] and returns every cached one with the boolean mask [b, 1, s, keys] that
hides padding and future keys. RoPE tables may then carry a batch dimension ([b, s, rotary_dim // 2]: each
left-padded sequence counts positions from its own first token).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from meshloom.models.common import qk_clip
from meshloom.models.common.init import trunc_normal_
from meshloom.models.common.norm import RMSNorm
from meshloom.models.common.rope import apply_rope

RopeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """The attention core over [b, heads, s, head_dim]: each query sees itself and earlier keys.

    With ``document_ids`` [b, s] a query also sees only keys of its own
    document (a block-diagonal causal mask), so documents packed into one
    sequence do not read each other. RoPE positions are not restarted per
    document: a rotated q.k depends only on the distance between the two
    tokens, so inside one block the scores equal those of the document alone.
    v may have another head size than q and k.
    """
    if document_ids is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    s = q.shape[-2]
    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    same_document = document_ids[:, :, None] == document_ids[:, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(same_document & causal)[:, None])


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attention with an explicit boolean mask [b, 1, s_q, s_k] (True = may attend), as a KV cache needs."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def rotate(rope: RopeFn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply `rope` to x [b, s, heads, dim] with tables [s, d] (shared by the batch) or [b, s, d] (per sequence).

    Per-sequence tables go through the same function by folding the batch into the sequence: a rotation
    only looks at its own row, so [1, b*s] with [b*s] tables is the same computation.
    """
    if cos.dim() == 2:
        return rope(x, cos, sin)
    b, s = x.shape[:2]
    return rope(x.reshape(1, b * s, *x.shape[2:]), cos.reshape(b * s, -1), sin.reshape(b * s, -1)).view(x.shape)


class GroupedQueryAttention(nn.Module):
    """Causal grouped-query self-attention (several query heads share a kv head).

    qk_norm_eps: when set, each head's q and k are RMS-normalised over head_dim before RoPE (QK-norm).
    rope: how channels are paired for the rotation (see meshloom.models.common.rope).
    """

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        qk_norm_eps: float | None = None,
        rope: RopeFn = apply_rope,
    ):
        super().__init__()
        self.head_dim = head_dim
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)
        self.q_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.rope = rope
        # Swappable from outside (context parallel puts a ring over the sequence shards here).
        self.core = causal_attention
        # Set only while generating (meshloom.inference.kv_cache.KVCache installs and removes it).
        self.kv_cache = None
        # QK-clip turns this on: training forwards then record each local head's largest logit (see qk_clip.py).
        self.track_max_logits = False
        self.max_logits: torch.Tensor | None = None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, document_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        b, s, _ = x.shape
        # The RoPE tables are cut to length here, where the sequence is whole: between blocks it may be
        # sequence-sharded (tensor parallel), as in the input of a later pipeline stage. Per-sequence tables
        # ([b, s, d], generation with a KV cache) already have the right length.
        if cos.dim() == 2:
            cos, sin = cos[:s], sin[:s]
        # -1 heads: under tensor parallel each rank sees only its local heads.
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate(self.rope, q, cos, sin), rotate(self.rope, k, cos, sin)

        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads, s, head_dim]
        mask = None
        if self.kv_cache is not None:
            k, v, mask = self.kv_cache.update(k, v)
        if self.track_max_logits and self.training:
            qk_clip.track(self, q, k, document_ids)
        n_rep = q.shape[1] // k.shape[1]
        # A core that takes grouped keys and values (ring attention, which then passes n_rep times fewer bytes)
        # expands them itself.
        if n_rep > 1 and not (getattr(self.core, "grouped_kv", False) and mask is None):
            # Query head i reads kv head i // n_rep; an explicit copy works with
            # every SDPA backend and with sharded tensors.
            k = k.repeat_interleave(n_rep, dim=1)
            v = v.repeat_interleave(n_rep, dim=1)
        out = self.core(q, k, v, document_ids) if mask is None else masked_attention(q, k, v, mask)
        out = out.transpose(1, 2).contiguous().view(b, s, -1)
        return self.wo(out)

    def init_weights(self, std: float, out_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            trunc_normal_(linear.weight, std)
        trunc_normal_(self.wo.weight, out_std)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.init_weights()
