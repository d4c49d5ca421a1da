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

Multi-head latent attention has no per-head key projection: a head's key is its own position-free part (through the kv
up-projection) next to one rotated key shared by every head. ``MLAClipTarget`` follows the Kimi K2 report for it.

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

    def row_factors(self, max_logits: Tensor, tau: float) -> list[tuple[Tensor, Tensor]]:
        """(parameter, factor of each of its global rows) for the heads' maxima [n_heads]; rows of untouched heads
        get 1."""
        q_factor, k_factor = clip_factors(max_logits, tau, self.n_kv_heads)
        return [(self.wq, q_factor.repeat_interleave(self.head_dim)), (self.wk, k_factor.repeat_interleave(self.head_dim))]


@dataclass(frozen=True)
class MLAClipTarget:
    """One multi-head latent attention layer (meshloom.models.common.mla), clipped as the Kimi K2 report does.

    A head's logit is ``q_C . k_C + q_R . k_R`` (scaled): q_C and q_R are its rows of ``wq`` (the query projection, or
    the q-LoRA up-projection ``wq_b``), ``qk_nope`` then ``qk_rope`` rows per head; k_C is its ``qk_nope`` rows of the
    kv up-projection ``wkv_b`` (followed by its ``v_head_dim`` value rows); k_R is the one rotated key every head
    shares. With ``gamma = tau / max`` for a head above tau: q_C and k_C rows scale by sqrt(gamma), q_R rows by gamma,
    and the shared rotary key (and every value row) stays as it is, so the head's logits scale by exactly gamma."""

    name: str
    attention: nn.Module
    wq: Tensor
    wkv_b: Tensor
    n_heads: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    def row_factors(self, max_logits: Tensor, tau: float) -> list[tuple[Tensor, Tensor]]:
        gamma = torch.where(max_logits > tau, tau / max_logits, torch.ones_like(max_logits))[:, None]
        root, one = gamma.sqrt(), torch.ones_like(gamma)
        q_rows = torch.cat([root.expand(-1, self.qk_nope_head_dim), gamma.expand(-1, self.qk_rope_head_dim)], dim=1)
        kv_rows = torch.cat([root.expand(-1, self.qk_nope_head_dim), one.expand(-1, self.v_head_dim)], dim=1)
        return [(self.wq, q_rows.flatten()), (self.wkv_b, kv_rows.flatten())]


ClipTarget = QKClipTarget | MLAClipTarget


def mla_clip_target(name: str, attention: nn.Module) -> MLAClipTarget:
    """The target of a MultiHeadLatentAttention module, q-LoRA on (wq_b) or off (wq)."""
    wq = (attention.wq if attention.wq is not None else attention.wq_b).weight
    return MLAClipTarget(
        name, attention, wq, attention.wkv_b.weight, wq.shape[0] // attention.qk_head_dim,
        attention.qk_nope_head_dim, attention.qk_rope_head_dim, attention.v_head_dim,
    )  # fmt: skip


@torch.no_grad()
def head_max_logits(
    q: Tensor,
    k: Tensor,
    document_ids: Tensor | None = None,
    positions: tuple[Tensor, Tensor] | None = None,
    key_document_ids: Tensor | None = None,
) -> Tensor:
    """Per query head, the largest logit the softmax sees: q [b, hq, sq, d], k [b, hkv, sk, d] (hq a multiple of hkv,
    query head i reads kv head i // (hq / hkv)) -> float32 [hq]. Scores are formed one kv head's group at a time, so at
    most [b, hq / hkv, sq, sk] of them exist at once; the scale is SDPA's default, 1 / sqrt(d). Without `positions`
    q and k are the same whole sequences (causal: key j <= query i, and inside one document under `document_ids`);
    with ``positions = (q_positions [sq], k_positions [sk])`` a query sees the keys at or before its position (a
    context-parallel shard of queries against the whole sequence's keys), and `document_ids` [b, sq] are the
    queries' documents, `key_document_ids` [b, sk] the keys'."""
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    n_rep = hq // hkv
    scale = 1.0 / math.sqrt(d)
    if positions is None:
        allowed = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril()
    else:
        allowed = positions[1][None, :] <= positions[0][:, None]
    if document_ids is not None:
        key_documents = document_ids if key_document_ids is None else key_document_ids
        allowed = allowed & (document_ids[:, :, None] == key_documents[:, None, :])  # [b, sq, sk]
    allowed = allowed.expand(b, sq, sk)[:, None]
    maxima = []
    for g in range(hkv):
        scores = q[:, g * n_rep : (g + 1) * n_rep].float() @ k[:, g, None].float().transpose(-1, -2)
        scores = scores.masked_fill(~allowed, float("-inf"))
        maxima.append(scores.amax(dim=(0, 2, 3)) * scale)
    return torch.cat(maxima)


def track(attention: nn.Module, q: Tensor, k: Tensor, document_ids: Tensor | None) -> None:
    """Fold this forward's per-head maxima into ``attention.max_logits`` (the step's running maximum), once per
    forward (not again when activation checkpointing recomputes it in backward). An attention core that holds only a
    shard of the sequence (context parallel's ring) offers ``whole_sequence_keys(k, document_ids) -> (keys,
    q_positions, k_positions, key_document_ids)``: this rank's queries are then scored against every key of the
    sequence that they see, inside their own document under a document mask."""
    if not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1:
        # Activation checkpointing recomputes this forward inside backward: its maxima were taken in the forward
        # itself, and a selective policy refuses ops that the forward did not run (here the running maximum).
        return
    whole = getattr(attention.core, "whole_sequence_keys", None)
    if whole is None:
        current = head_max_logits(q, k, document_ids)
    else:
        keys, q_positions, k_positions, key_documents = whole(k, document_ids)
        current = head_max_logits(q, keys, document_ids, (q_positions, k_positions), key_documents)
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
def scale_rows_(local: Tensor, first_row: int, row_factors: Tensor) -> None:
    """Multiply a local block of a weight, starting at global row ``first_row``, by its rows' factors."""
    rows = row_factors[first_row : first_row + local.shape[0]]
    local.mul_(rows.to(local.dtype)[:, None])
