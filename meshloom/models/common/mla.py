"""Multi-head latent attention (MLA, DeepSeek-V2/V3): keys and values rebuilt from a small shared latent.

Per token, the input is compressed to a latent of `kv_lora_rank` channels (RMS-normalised), from which every
head's key (its position-free part, `qk_nope_head_dim`) and value (`v_head_dim`) are projected back up. Position
enters through `qk_rope_head_dim` extra channels: each query head has its own, while the rotated key channels
are one tensor, projected straight from the input and shared by all heads. Queries come either straight from
the input (`q_lora_rank` = 0) or through a low-rank bottleneck with its own RMSNorm.

    q   = wq(x)  or  wq_b(q_norm(wq_a(x)))                  [b, s, heads, nope + rope]
    latent, k_rope = wkv_a(x)                               [b, s, kv_lora], [b, s, rope]
    k_nope, v = wkv_b(kv_norm(latent))                      [b, s, heads, nope], [b, s, heads, v]
    k   = [k_nope, rope(k_rope) for every head]

The value head size may differ from the query/key head size; the attention core takes that as it is. Head
counts are read off tensor shapes, so column-sharded up-projections (tensor parallel) give each rank its local
heads. Two attributes may be replaced from outside: `core` (the attention kernel; context parallel puts a ring
there) and `shared_rope_key`, an identity every head's rotated key passes through, where tensor parallel sums
that shared tensor's gradient over the ranks' heads.

Inference: `kv_cache` (None while training; see meshloom.inference.kv_cache) stores what MLA needs per token, the
normalised latent and the rotated shared key (kv_lora_rank + qk_rope_head_dim values, not every head's keys and
values), and the keys and values of all cached tokens are projected up from it at each step. RoPE tables may then
carry a batch dimension ([b, s, rope / 2], per-sequence positions).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from meshloom.models.common import qk_clip
from meshloom.models.common.attention import RopeFn, causal_attention, masked_attention, rotate
from meshloom.models.common.init import trunc_normal_
from meshloom.models.common.norm import RMSNorm
from meshloom.models.common.rope import apply_rope

# The latent norms' epsilon in DeepSeek's reference code and in Hugging Face's port (not the config's rms_norm_eps).
LATENT_NORM_EPS = 1e-6


class MultiHeadLatentAttention(nn.Module):
    """Causal multi-head latent attention.

    softmax_scale: the scale of q.k before the softmax; None means 1/sqrt(qk head dim). (YaRN sharpens it.)
    rope: how the rotary channels are paired (see meshloom.models.common.rope).
    """

    def __init__(
        self,
        dim: int,
        n_heads: int,
        q_lora_rank: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        softmax_scale: float | None = None,
        rope: RopeFn = apply_rope,
    ):
        super().__init__()
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.kv_lora_rank = kv_lora_rank
        q_out = n_heads * self.qk_head_dim
        if q_lora_rank:
            self.wq, self.wq_a = None, nn.Linear(dim, q_lora_rank, bias=False)
            self.q_norm = RMSNorm(q_lora_rank, LATENT_NORM_EPS)
            self.wq_b = nn.Linear(q_lora_rank, q_out, bias=False)
        else:
            self.wq, self.wq_a, self.q_norm, self.wq_b = nn.Linear(dim, q_out, bias=False), None, None, None
        self.wkv_a = nn.Linear(dim, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(kv_lora_rank, LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(kv_lora_rank, n_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.wo = nn.Linear(n_heads * v_head_dim, dim, bias=False)
        self.rope = rope
        # Every head reads this one rotated key; tensor parallel hooks a gradient sum over its ranks' heads here.
        self.shared_rope_key = nn.Identity()
        # Swappable from outside (context parallel puts a ring over the sequence shards here).
        self.core = causal_attention
        # Set only while generating (meshloom.inference.kv_cache.KVCache installs and removes it).
        self.kv_cache = None
        # QK-clip turns this on: training forwards then record each local head's largest logit (see qk_clip.py).
        self.track_max_logits = False
        self.max_logits: torch.Tensor | None = None
        # The core scales by 1/sqrt(qk head dim); a different softmax scale is folded into q instead, so that
        # every core (SDPA, the context-parallel ring) keeps its plain signature.
        scale = self.qk_head_dim**-0.5 if softmax_scale is None else softmax_scale
        self.q_scale = scale * math.sqrt(self.qk_head_dim)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, document_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        # Shapes come from the projections' outputs, not from x: under tensor parallel x arrives sequence-sharded
        # and the up-projections return the whole sequence for the rank's own heads.
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_norm(self.wq_a(x)))
        q = q.unflatten(-1, (-1, self.qk_head_dim))  # [b, s, heads, qk]
        s = q.shape[1]
        if cos.dim() == 2:  # per-sequence tables ([b, s, d], generation) already have the right length
            cos, sin = cos[:s], sin[:s]
        q_nope, q_rope = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q = torch.cat((q_nope, rotate(self.rope, q_rope, cos, sin)), dim=-1)
        latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        latent = self.kv_norm(latent)
        k_rope = self.shared_rope_key(rotate(self.rope, k_rope.unsqueeze(2), cos, sin))  # [b, s, 1, rope]
        mask = None
        if self.kv_cache is not None:  # every cached token's latent and rotated key: [b, 1, tokens, ...]
            latent, k_rope, mask = self.kv_cache.update(latent.unsqueeze(1), k_rope.transpose(1, 2))
            latent, k_rope = latent.squeeze(1), k_rope.transpose(1, 2)
        kv = self.wkv_b(latent).unflatten(-1, (-1, self.qk_nope_head_dim + self.v_head_dim))
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat((k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)), dim=-1)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads, s, head_dim]
        if self.track_max_logits and self.training:  # q carries the softmax scale: these are the real logits
            qk_clip.track(self, q, k, document_ids)
        out = self.core(q, k, v, document_ids) if mask is None else masked_attention(q, k, v, mask)
        return self.wo(out.transpose(1, 2).flatten(2))

    def init_weights(self, std: float, out_std: float) -> None:
        for linear in (self.wq, self.wq_a, self.wq_b, self.wkv_a, self.wkv_b):
            if linear is not None:
                trunc_normal_(linear.weight, std)
        trunc_normal_(self.wo.weight, out_std)
        for norm in (self.q_norm, self.kv_norm):
            if norm is not None:
                norm.init_weights()
