"""FlexAttention, meshloom's second attention kernel: masks that are more than causal, and attention sinks.

A mask is described once, as a `MaskSpec` (a sliding window, packed documents, or both, on top of the causal
mask), and turned into torch's FlexAttention ``mask_mod``. Sinks are one learned logit per head that joins every
query's softmax as an extra key with no value: the weights of the real keys then sum to less than one. FlexAttention
returns each query row's log-sum-exp (lse) of its visible scores, so the sink costs one rescale afterwards:

    out_with_sink = out * exp(lse) / (exp(lse) + exp(sink)) = out * sigmoid(lse - sink)

and the gradient reaches the sink logit, and q and k through lse, by ordinary autograd.

Where it runs:

* CUDA: torch's ``flex_attention`` (compiled into a fused kernel when the model is compiled).
* CPU: torch 2.13's public ``flex_attention`` refuses inputs that require gradients on CPU ("does not support
  backward on CPU"), and its compiled CPU kernel is inference-only. The eager FlexAttention operator underneath
  it does have a CPU forward and backward (it evaluates the same mask_mod over the whole score matrix: correct,
  and fast enough for the tiny models of the tests), so CPU runs call that operator directly. Compiling a model
  whose attention is FlexAttention on CPU is refused before the run starts (see the README).

``masked_attention_with_sinks`` is the same computation over an explicit boolean mask, for decoding with a KV cache
(one query row against a growing cache, where a block mask per step would cost more than it saves).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import flex_attention as flex

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class MaskSpec:
    """Which keys a query sees, beyond "itself and earlier keys": with `window`, a query at position i sees keys at
    positions j with i - j < window (None: every earlier key), as Hugging Face's sliding-window layers count it.
    Document ids, which change with every batch, are given to `mask_mod` (a query then also sees only keys of its
    own document)."""

    window: int | None = None

    def mask_mod(self, document_ids: torch.Tensor | None) -> MaskMod:
        """The FlexAttention mask_mod (batch, head, query index, key index) -> visible, for one batch."""
        window = self.window

        def visible(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            keep = kv <= q
            if window is not None:
                keep = keep & (q - kv < window)
            if document_ids is not None:
                keep = keep & (document_ids[b, q] == document_ids[b, kv])
            return keep

        return visible

    def dense(self, s_q: int, s_k: int, device: torch.device, query_offset: int = 0) -> torch.Tensor:
        """The causal-and-window part as an explicit boolean mask [s_q, s_k]; query i sits at key index
        query_offset + i (decoding: the cached keys come first)."""
        q = torch.arange(s_q, device=device)[:, None] + query_offset
        kv = torch.arange(s_k, device=device)[None, :]
        keep = kv <= q
        if self.window is not None:
            keep = keep & (q - kv < self.window)
        return keep


def _block_mask(spec: MaskSpec, document_ids: torch.Tensor | None, b: int, s: int, device: torch.device) -> flex.BlockMask:
    # Without documents the mask is the same for every sequence: one block mask broadcast over the batch.
    batch = b if document_ids is not None else None
    return flex.create_block_mask(spec.mask_mod(document_ids), batch, None, s, s, device=device)


class _BlockMasks:
    """The block mask of the latest batch per MaskSpec: every layer of a forward with the same spec and document ids
    shares one (a model alternates between two specs at most). The ids tensor itself is kept and compared by
    identity, as the batch's tensor passes unchanged through every layer."""

    def __init__(self) -> None:
        self._cache: dict[MaskSpec, tuple[torch.Tensor | None, tuple, flex.BlockMask]] = {}

    def get(self, spec: MaskSpec, document_ids: torch.Tensor | None, b: int, s: int, device: torch.device) -> flex.BlockMask:
        shape = (b, s, device)
        hit = self._cache.get(spec)
        if hit is not None and hit[0] is document_ids and hit[1] == shape:
            return hit[2]
        mask = _block_mask(spec, document_ids, b, s, device)
        self._cache[spec] = (document_ids, shape, mask)
        return mask


_MASKS = _BlockMasks()


def _eager_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: flex.BlockMask, scale: float):
    """(out, natural-log lse) from the eager FlexAttention operator (CPU forward and backward)."""
    from torch._higher_order_ops.flex_attention import flex_attention as flex_operator

    options = flex._apply_kernel_options(q, k, v, True, None, None)
    out, lse, _ = flex_operator(q, k, v, flex._identity, block_mask.as_tuple(), scale, options)
    # The operator keeps its row statistics in base 2 unless it runs the FLASH backend (torch's own wrapper converts
    # them the same way).
    return out, lse * math.log(2.0) if options.get("BACKEND") != "FLASH" else lse


def flex_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spec: MaskSpec,
    document_ids: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    scale: float | None = None,
    eager_operator: bool = True,
) -> torch.Tensor:
    """Attention of q [b, heads, s, d] over k, v [b, kv_heads, s, d] (kv_heads a divisor of heads: grouped-query)
    under `spec`, with one sink logit per head [heads] when given. Returns [b, heads, s, d] in q's dtype.
    eager_operator: the eager FlexAttention operator, which trains on any device (CPU needs it), rather than torch's
    flex_attention (CUDA: the fused kernel once compiled); the run's kernel plan decides."""
    b, _, s, d = q.shape
    scale = d**-0.5 if scale is None else scale
    block_mask = _MASKS.get(spec, document_ids, b, s, q.device)
    if eager_operator:
        out, lse = _eager_flex(q, k, v, block_mask, scale)
    else:
        out, aux = flex.flex_attention(
            q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True, return_aux=flex.AuxRequest(lse=True)
        )
        lse = aux.lse
    if sinks is None:
        return out
    # The sink joins the softmax as one more logit: the real keys' weights shrink by exp(lse) / (exp(lse) + exp(sink)).
    keep = torch.sigmoid(lse.float() - sinks.float()[None, :, None])
    return (out.float() * keep[..., None]).to(q.dtype)


def masked_attention_with_sinks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    sinks: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """The same attention over an explicit boolean mask [b or 1, 1, s_q, s_k] (True = may attend), with k and v
    already holding as many heads as q. Every row must see at least one key."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.float()[None, :, None, None].expand(*scores.shape[:-1], 1)
        # The sink's column takes part in the softmax and is dropped afterwards.
        probs = F.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = F.softmax(scores, dim=-1)
    return torch.matmul(probs, v.float()).to(q.dtype)


class FlexAttentionCore:
    """The attention core of a model whose kernel is FlexAttention: causal, with a window, documents and sinks when
    given. Context parallel swaps it for the ring (meshloom.parallel.context.RingAttentionCore), which takes the
    same arguments. Which FlexAttention runs is a plain value (`configured` takes the run's kernel plan); the default,
    the eager operator, runs everywhere."""

    # k and v arrive with their own (grouped) heads; FlexAttention reads query head i from kv head i // n_rep itself.
    grouped_kv = True

    def __init__(self, eager_operator: bool = True):
        self.eager_operator = eager_operator

    def configured(self, eager_operator: bool = True, **_: object) -> FlexAttentionCore:
        return FlexAttentionCore(eager_operator)

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        document_ids: torch.Tensor | None = None,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return flex_attention(q, k, v, MaskSpec(window=window), document_ids, sinks, eager_operator=self.eager_operator)


flex_core = FlexAttentionCore()
