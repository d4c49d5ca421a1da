"""Context parallel: each rank of the cp group holds a shard of every sequence; attention runs as a ring.

Sequence layout (see sequence_layout.py). The sequence is cut into equal chunks: contiguous (rank r holds chunk r),
head-tail (rank r holds chunks r and 2*cp-1-r, which balances a causal mask), or per batch by attention work given
where the packed documents fall (document_balance.py). Inputs, labels, document ids and RoPE positions are all cut
by the same layout, so each rank's token losses are exactly the unsharded ones.

Ring attention. Every rank keeps its queries; the key/value shards travel around the ring, one hop per step.
Each visiting block gives a partial softmax over its keys (an output and its log-sum-exp), and partial results
are merged exactly with log-sum-exp arithmetic. The next block is already in flight while the current one is
computed. Backward runs the same ring: key/value shards travel again, and their gradient accumulators follow
one hop behind, arriving back at their owner after the last step. Blocks that the causal mask hides entirely
are skipped, which is where load balancing pays. With document ids (a block-diagonal causal mask) each block is
also cut to the queries and keys that share a document, or skipped when none do (see ring_blocks.py). A sliding
window cuts blocks the same way. Attention sinks (one extra softmax logit per head, without a value) are applied
after the merge from each row's log-sum-exp, which the ring returns with its gradient.

Everything is public torch ops (matmul, logsumexp, batch_isend_irecv), so it runs on CPU (gloo) and CUDA
(NCCL) alike; partial results are kept in float32 whatever the input dtype.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.distributed as dist

# The layout and batch sharding live in sequence_layout.py and document_balance.py; importers of this module
# find them here too.
from meshloom.parallel.document_balance import BatchSharder, batch_sharder
from meshloom.parallel.ring_blocks import BlockCache, RingBlocks, gather_documents
from meshloom.parallel.sequence_layout import Layout, SequenceLayout, positions_hook

__all__ = ["BatchSharder", "Layout", "RingAttentionCore", "SequenceLayout", "batch_sharder", "positions_hook", "ring_attention"]

# Upper bound on the elements of one score tile [b, heads, rows, keys]: long shards are processed a few query
# rows at a time so the transient scores stay small (4 MiB in float32).
SCORE_TILE_ELEMENTS = 2**20

# Message tags: key/value blocks and gradient accumulators may be in flight between the same pair at once.
_KV_TAG = 1
_GRAD_TAG = 2


# ---------------------------------------------------------------------------
# Attention over one block (float32), forward and backward
# ---------------------------------------------------------------------------


def _tile_rows(q: torch.Tensor, kv_len: int) -> int:
    batch_heads = q.shape[0] * q.shape[1]
    return max(1, min(q.shape[2], SCORE_TILE_ELEMENTS // max(1, batch_heads * kv_len)))


def _tile_scores(
    q_tile: torch.Tensor, k: torch.Tensor, first_row: int, scale: float, causal: bool, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Scaled scores of a tile of query rows against k; causal: query row i sees keys 0..i (same chunk); `mask`
    [b, rows, keys] (the tile's rows, k's keys): False hides a key from a query."""
    scores = torch.matmul(q_tile, k.transpose(-1, -2)) * scale
    if causal:
        visible = torch.ones(q_tile.shape[-2], k.shape[-2], dtype=torch.bool, device=q_tile.device)
        scores = scores.masked_fill(~visible.tril(diagonal=first_row), float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None], float("-inf"))
    return scores


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (rows that see no key) as 0, so that exp(score - lse) is exp(-inf) = 0 there, not NaN."""
    return lse.masked_fill(torch.isneginf(lse), 0.0)


def _row_tiles(q: torch.Tensor, kv_len: int, causal: bool) -> Iterator[tuple[int, int, int]]:
    """(first row, end row, keys needed): a causal tile needs only the keys up to its last row."""
    rows = _tile_rows(q, kv_len)
    for start in range(0, q.shape[2], rows):
        end = min(q.shape[2], start + rows)
        yield start, end, end if causal else kv_len


def block_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q over one key block: (output, log-sum-exp of the scores), both float32. The output has
    v's head size, which may differ from q's and k's. A row that `mask` [b, q rows, keys] hides from every key
    gets an output of 0 and a log-sum-exp of -inf."""
    out = torch.empty((*q.shape[:-1], v.shape[-1]), dtype=torch.float32, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    for start, end, kv_end in _row_tiles(q, k.shape[2], causal):
        tile_mask = None if mask is None else mask[:, start:end, :kv_end]
        scores = _tile_scores(q[:, :, start:end], k[:, :, :kv_end], start, scale, causal, tile_mask)
        tile_lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - (tile_lse if mask is None else _finite(tile_lse))[..., None])
        out[:, :, start:end] = torch.matmul(probs, v[:, :, :kv_end])
        lse[:, :, start:end] = tile_lse
    return out, lse


def block_attention_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    scale: float,
    causal: bool,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of one block's share of attention.

    `lse` is the log-sum-exp over *all* keys the queries see and `delta` = rowsum(grad_out * final output), so
    the recomputed probabilities are the final softmax's and the per-block gradients add up exactly.
    """
    dq = torch.empty_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    for start, end, kv_end in _row_tiles(q, k.shape[2], causal):
        q_tile, k_seen, v_seen = q[:, :, start:end], k[:, :, :kv_end], v[:, :, :kv_end]
        tile_mask = None if mask is None else mask[:, start:end, :kv_end]
        probs = torch.exp(_tile_scores(q_tile, k_seen, start, scale, causal, tile_mask) - lse[:, :, start:end, None])
        grad_tile = grad_out[:, :, start:end]
        dv[:, :, :kv_end] += torch.matmul(probs.transpose(-1, -2), grad_tile)
        grad_scores = probs * (torch.matmul(grad_tile, v_seen.transpose(-1, -2)) - delta[:, :, start:end, None])
        dq[:, :, start:end] = torch.matmul(grad_scores, k_seen) * scale
        dk[:, :, :kv_end] += torch.matmul(grad_scores.transpose(-1, -2), q_tile) * scale
    return dq, dk, dv


def merge_partial(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold one block's (output, log-sum-exp) into the running ones, in place: softmax over the union of keys.

    Rows that have seen no key yet on either side (-inf and -inf, under a document mask) stay 0 and -inf."""
    merged = torch.logaddexp(lse, block_lse)
    safe = _finite(merged)
    out.mul_(torch.exp(lse - safe)[..., None]).add_(block_out * torch.exp(block_lse - safe)[..., None])
    lse.copy_(merged)


# ---------------------------------------------------------------------------
# The ring
# ---------------------------------------------------------------------------


class _InFlight:
    """A tensor on its way from the previous rank."""

    def __init__(self, works: list, buffer: torch.Tensor):
        self.works = works
        self.buffer = buffer

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        return self.buffer


class Ring:
    """Point-to-point neighbours in a process group: send to rank + 1, receive from rank - 1."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def pass_on(self, tensor: torch.Tensor, tag: int) -> _InFlight:
        """Start sending `tensor` to the next rank and receiving its counterpart from the previous one."""
        buffer = torch.empty_like(tensor)
        ops = [
            dist.P2POp(dist.isend, tensor, group=self.group, group_peer=(self.rank + 1) % self.size, tag=tag),
            dist.P2POp(dist.irecv, buffer, group=self.group, group_peer=(self.rank - 1) % self.size, tag=tag),
        ]
        return _InFlight(dist.batch_isend_irecv(ops), buffer)


def _pack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Keys and values as one message (joined on the head dimension, which may differ between them)."""
    return torch.cat((k, v), dim=-1)


def _unpack(kv: torch.Tensor, k_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    return kv[..., :k_dim], kv[..., k_dim:]


def _expand_heads(t: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Grouped-query attention: query head i reads key/value head i // n_rep. The ring carries the key/value heads
    only, n_rep times fewer bytes per hop, and each rank expands the block it holds."""
    return t.repeat_interleave(n_rep, dim=1) if n_rep > 1 else t


def _sum_heads(t: torch.Tensor, n_rep: int) -> torch.Tensor:
    """The gradient of _expand_heads: each key/value head collects its n_rep query heads' gradients."""
    return t.unflatten(1, (-1, n_rep)).sum(2) if n_rep > 1 else t


def _ring_forward(q, k, v, ring: Ring, blocks: RingBlocks, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(output in q's dtype, float32 log-sum-exp) of this rank's queries over every rank's keys."""
    k_dim, n_rep = k.shape[-1], q.shape[1] // k.shape[1]
    q32 = q.float()
    out = torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    kv = _pack(k, v)  # one message per hop, in the input dtype
    for step in range(ring.size):
        # The next block travels while this one is computed.
        incoming = ring.pass_on(kv, _KV_TAG) if step < ring.size - 1 else None
        owner = (ring.rank - step) % ring.size
        k32, v32 = (_expand_heads(t.float(), n_rep) for t in _unpack(kv, k_dim))
        for block in blocks(owner):
            rows, keys = block.rows, block.keys
            block_out, block_lse = block_attention(
                q32[:, :, rows], k32[:, :, keys], v32[:, :, keys], scale, block.causal, block.mask
            )
            merge_partial(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
        if incoming is not None:
            kv = incoming.wait()
    return out.to(q.dtype), lse


def _ring_backward(q, k, v, out, lse, grad_out, ring: Ring, blocks: RingBlocks, scale: float, grad_lse=None):
    """(dq, dk, dv) of this rank's shard; each key/value block's gradient comes home from the ranks it visited.

    `grad_lse`: the gradient of the returned log-sum-exp (attention sinks use it). d lse / d score = the softmax
    probability, so it adds grad_lse * p to each score's gradient p * (dO.v - delta): the same formula with delta
    lowered by grad_lse."""
    k_dim, n_rep = k.shape[-1], q.shape[1] // k.shape[1]
    q32, grad32 = q.float(), grad_out.float()
    delta = (grad32 * out.float()).sum(-1)
    if grad_lse is not None:
        delta = delta - grad_lse.float()
    dq = torch.zeros_like(q32)
    kv = _pack(k, v)
    grad_in_flight: _InFlight | None = None
    for step in range(ring.size):
        incoming = ring.pass_on(kv, _KV_TAG) if step < ring.size - 1 else None
        owner = (ring.rank - step) % ring.size
        k32, v32 = (_expand_heads(t.float(), n_rep) for t in _unpack(kv, k_dim))
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=k.device)
        dk, dv = _unpack(dkv, k_dim)
        for block in blocks(owner):
            rows, keys = block.rows, block.keys
            dq_block, dk_block, dv_block = block_attention_backward(
                q32[:, :, rows], k32[:, :, keys], v32[:, :, keys],
                grad32[:, :, rows], lse[:, :, rows], delta[:, :, rows], scale, block.causal, block.mask,
            )
            dq[:, :, rows] += dq_block
            dk[:, :, keys] += _sum_heads(dk_block, n_rep)
            dv[:, :, keys] += _sum_heads(dv_block, n_rep)
        if grad_in_flight is not None:
            # The gradient this block collected on the ranks it visited before this one.
            dkv += grad_in_flight.wait()
        # Follow the block to its next rank; after the last step that rank is its owner.
        grad_in_flight = ring.pass_on(dkv, _GRAD_TAG)
        if incoming is not None:
            kv = incoming.wait()
    dk, dv = _unpack(grad_in_flight.wait(), k_dim)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    # Autocast is off inside: the partial results must stay float32 whatever the surrounding region asks for.

    # Returns (output, float32 log-sum-exp); the log-sum-exp may take part in the loss (attention sinks).

    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, blocks: RingBlocks, scale: float):
        with torch.autocast(q.device.type, enabled=False):
            out, lse = _ring_forward(q, k, v, ring, blocks, scale)
        ctx.ring, ctx.blocks, ctx.scale = ring, blocks, scale
        ctx.save_for_backward(q, k, v, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):
            dq, dk, dv = _ring_backward(q, k, v, out, lse, grad_out, ctx.ring, ctx.blocks, ctx.scale, grad_lse)
        return dq, dk, dv, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ring: Ring,
    layout: Layout,
    scale: float | None = None,
    document_ids: torch.Tensor | None = None,
    blocks: RingBlocks | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's sequence shard over the whole sequence held by the ring.

    q, k, v: [b, heads, shard_len, head_dim], laid out by `layout`; k and v may have fewer heads than q (grouped-query
    attention: a divisor of q's, query head i reading key/value head i // (q heads / kv heads)); v's head_dim may
    differ from q's and k's. With `document_ids` [b, shard_len] (this rank's shard) a query sees only keys of
    its own document. `blocks` may carry the blocks already built for this batch (see ring_blocks.BlockCache).
    """
    layout = layout.resolve()
    if q.shape[2] % layout.chunks_per_rank:
        raise ValueError(f"shard length {q.shape[2]} is not divisible by {layout.chunks_per_rank} chunks per rank")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if ring.size == 1:
        n_rep = q.shape[1] // k.shape[1]
        k, v = _expand_heads(k, n_rep), _expand_heads(v, n_rep)
        if document_ids is None:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        same = (document_ids[:, :, None] == document_ids[:, None, :]).tril()
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=same[:, None], scale=scale)
    if blocks is None:
        documents = None if document_ids is None else gather_documents(document_ids, ring.group)
        blocks = RingBlocks(layout, ring.rank, q.shape[2], documents)
    return _RingAttention.apply(q, k, v, ring, blocks, scale)[0]


class RingAttentionCore:
    """An attention core (q, k, v[, document_ids] -> out) for models whose attention kernel is swappable. It takes
    grouped-query keys and values unexpanded (`grouped_kv`), so the ring passes only the key/value heads."""

    grouped_kv = True

    def __init__(self, group: dist.ProcessGroup, layout: Layout):
        self.ring = Ring(group)
        self.layout = layout
        self.blocks = BlockCache(group)

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        document_ids: torch.Tensor | None = None,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """document_ids [b, shard_len]: this rank's shard of the batch's ids (a block-diagonal causal mask); window:
        a query sees only its last `window` keys; sinks [heads]: one more softmax logit per head, without a value."""
        layout = self.layout.resolve()
        if window is None and sinks is None:
            blocks = self.blocks.get(layout, q.shape[2], document_ids) if self.ring.size > 1 else None
            return ring_attention(q, k, v, self.ring, layout, document_ids=document_ids, blocks=blocks)
        if q.shape[2] % layout.chunks_per_rank:
            raise ValueError(f"shard length {q.shape[2]} is not divisible by {layout.chunks_per_rank} chunks per rank")
        blocks = self.blocks.get(layout, q.shape[2], document_ids, window, q.device)
        out, lse = _RingAttention.apply(q, k, v, self.ring, blocks, 1.0 / math.sqrt(q.shape[-1]))
        if sinks is None:
            return out
        # The sink joins each row's softmax: the keys' weights shrink by exp(lse) / (exp(lse) + exp(sink)).
        keep = torch.sigmoid(lse - sinks.float()[None, :, None])
        return (out.float() * keep[..., None]).to(q.dtype)

    @torch.no_grad()
    def whole_sequence_keys(
        self, k: torch.Tensor, document_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Every rank's key shard, gathered (no gradient): (keys [b, h, seq, d] in the ranks' shard order, this rank's
        query positions [seq / cp], the keys' positions [seq], the keys' document ids [b, seq] or None without
        `document_ids` [b, seq / cp], this rank's). QK-clip scores this rank's queries against them to find each
        head's largest logit over pairs that sit on different ranks."""
        cp, shard = self.ring.size, k.shape[2]
        layout = self.layout.resolve()
        # Concatenated along dim 0 (the layout gloo and NCCL both take), then each rank's shard put in sequence order.
        gathered = torch.empty((cp * k.shape[0], *k.shape[1:]), dtype=k.dtype, device=k.device)
        dist.all_gather_into_tensor(gathered, k.contiguous(), group=self.ring.group)
        keys = gathered.unflatten(0, (cp, k.shape[0])).permute(1, 2, 0, 3, 4).flatten(2, 3)
        positions = [layout.positions(cp * shard, r, k.device) for r in range(cp)]
        key_documents = document_ids
        if document_ids is not None and cp > 1:
            # The ring gathers the same ids for its masks right after this; the cache gathers them once for both.
            documents = self.blocks.get(layout, shard, document_ids).documents  # [cp, b, shard]
            key_documents = documents.permute(1, 0, 2).flatten(1)
        return keys, positions[self.ring.rank], torch.cat(positions), key_documents

    def __repr__(self) -> str:
        return f"RingAttentionCore(cp={self.ring.size}, load_balance={self.layout.load_balance})"
