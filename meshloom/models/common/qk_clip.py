"""QK-clip (the clip of Kimi K2's MuonClip): per-head maximum attention logits, and the per-head rescale that caps them.

The maximum logit of query head h is ``S_h = max q_i . k_j / sqrt(head_dim)`` over the pairs (i, j) the softmax sees
(causal, and inside one document under a document mask), over every sequence of the optimizer step. After the update,
a head with ``S_h > tau`` has its query and key projection rows scaled so that the same inputs would give at most tau:
the logit is bilinear in the two projections, so scaling q's rows by a and k's rows by b scales it by a*b.

Grouped-query attention shares one kv head between ``n_rep`` query heads, so k cannot be scaled per query head. The rule
here: a kv head g is scaled by ``sqrt(tau / S_g)`` with ``S_g`` the largest ``S_h`` of the query heads reading it (when
``S_g > tau``), and each query head h by ``min(1, tau / (S_h * k_factor_g))``. With one query head per kv head this is
Kimi K2's per-head rule (both by ``sqrt(tau / S_h)``); with groups, every head ends at most at tau, a head that alone
exceeds it is split evenly between q and k, and heads of the group that were already below tau keep their q rows (their
shared k shrinks with the group's worst head). Applied to weights, this assumes q and k are linear in their projection
rows up to a per-head rotation (RoPE): a family with QK-norm must not offer it (the norm would undo the scale).

Nothing here talks to other ranks: ``meshloom.train.qk_clip`` reduces the maxima over the ranks that see each head and
applies the factors to local shards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class QKClipTarget:
    """One attention layer QK-clip rescales. ``attention`` records the per-head maxima of its forward passes
    (``track_max_logits`` / ``max_logits``); ``wq`` and ``wk`` hold each head's ``head_dim`` rows contiguously,
    head-major (query head h: rows ``h * head_dim`` to ``(h + 1) * head_dim``), as whole (possibly sharded)
    parameters."""

    name: str
    attention: nn.Module
    wq: Tensor
    wk: Tensor
    n_heads: int
    n_kv_heads: int
    head_dim: int


@torch.no_grad()
def head_max_logits(q: Tensor, k: Tensor, document_ids: Tensor | None = None) -> Tensor:
    """Per query head, the largest logit the softmax sees: q [b, hq, s, d], k [b, hkv, s, d] (hq a multiple of hkv,
    query head i reads kv head i // (hq / hkv)) -> float32 [hq]. Scores are formed one kv head's group at a time, so at
    most [b, hq / hkv, s, s] of them exist at once; the scale is SDPA's default, 1 / sqrt(d)."""
    b, hq, s, d = q.shape
    hkv = k.shape[1]
    n_rep = hq // hkv
    scale = 1.0 / math.sqrt(d)
    allowed = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    if document_ids is not None:
        allowed = allowed & (document_ids[:, :, None] == document_ids[:, None, :])  # [b, s, s]
    allowed = allowed.expand(b, s, s)[:, None]
    maxima = []
    for g in range(hkv):
        scores = q[:, g * n_rep : (g + 1) * n_rep].float() @ k[:, g, None].float().transpose(-1, -2)
        scores = scores.masked_fill(~allowed, float("-inf"))
        maxima.append(scores.amax(dim=(0, 2, 3)) * scale)
    return torch.cat(maxima)


def track(attention: nn.Module, q: Tensor, k: Tensor, document_ids: Tensor | None) -> None:
    """Fold this forward's per-head maxima into ``attention.max_logits`` (the step's running maximum). Activation
    checkpointing recomputes the same values, which leaves a maximum unchanged."""
    current = head_max_logits(q, k, document_ids)
    previous = attention.max_logits
    attention.max_logits = current if previous is None else torch.maximum(previous, current)


def clip_factors(max_logits: Tensor, tau: float, n_kv_heads: int) -> tuple[Tensor, Tensor]:
    """(query-head factors [hq], kv-head factors [hkv]) by the rule in this module's docstring; all 1 where no head
    of the group exceeds tau."""
    n_heads = max_logits.numel()
    groups = max_logits.view(n_kv_heads, n_heads // n_kv_heads)
    group_max = groups.amax(dim=1)
    k_factor = torch.where(group_max > tau, (tau / group_max).sqrt(), torch.ones_like(group_max))
    after_k = max_logits * k_factor.repeat_interleave(n_heads // n_kv_heads)
    q_factor = torch.where(after_k > tau, tau / after_k, torch.ones_like(after_k))
    return q_factor, k_factor


@torch.no_grad()
def scale_head_rows_(local: Tensor, first_row: int, head_factors: Tensor, head_dim: int) -> None:
    """Multiply a local block of a projection weight, starting at global row ``first_row``, by its heads' factors."""
    rows = head_factors.repeat_interleave(head_dim)[first_row : first_row + local.shape[0]]
    local.mul_(rows.to(local.dtype)[:, None])
