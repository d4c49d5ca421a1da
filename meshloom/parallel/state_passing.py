"""State-passing context parallel for Gated DeltaNet layers: each rank's shard reduces to fixed-size state maps.

The chunked gated delta rule is affine in the state it starts from. Run from an incoming state S, a chunk of the
sequence ends in T S + B and its token t outputs o_t(0) + R_t S, where the transition T [dk, dk], the offset B
[dk, dv] and the readout rows R_t [dk] do not depend on S. One local pass from the state [0 | I] (the identity in
extra state columns that see zero values, see `chunk_gated_delta_rule`) yields all of them at once: its outputs are
[o(0) | R] and its final state [B | T].

So every rank runs its chunks (1 or 2, or the per-batch assignment's count) from zero, the (B, T) pairs are
all-gathered (their size does not depend on the sequence length), and each rank scans them in sequence order:
S_in(0) = 0, S_in(c + 1) = T_c S_in(c) + B_c, cut to zero where chunk c + 1 starts a new document (a document start
inside a chunk is already in that chunk's T, B and R: the kernel cuts the carried state there). Each rank then adds
R_t S_in(c) to its chunks' outputs. The scan over 2 x cp pairs is redundant on every rank; it is cp small matmuls.

The short causal convolution needs the K - 1 inputs before each chunk: the last K - 1 tokens of every chunk are
all-gathered and each chunk takes its history from those before it in sequence order, with their document ids.

Gradients: the all-gather's backward is a reduce-scatter (sum), so each rank's pairs and tails get every rank's
gradient for them, exactly. `bytes_sent` counts what this rank sends, by the ring model of
`meshloom/observe/comm_count.py` ((n - 1) x the local input for an all-gather and for its reduce-scatter).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.distributed as dist
from torch import Tensor

from meshloom.models.common.gated_delta import causal_depthwise_conv, chunk_gated_delta_rule
from meshloom.parallel.sequence_layout import Layout, SequenceLayout


@dataclass
class BytesSent:
    """Bytes this rank has sent over the cp group since the last `reset`, in forward and backward passes."""

    forward: int = 0
    backward: int = 0

    def reset(self) -> None:
        self.forward = self.backward = 0


def all_gather_rows(x: Tensor, group: dist.ProcessGroup, counter: BytesSent) -> Tensor:
    """Every rank's `x` concatenated along dim 0 (rank order), differentiable: the gradient is reduce-scattered."""
    if x.requires_grad:
        return _AllGather.apply(x, group, counter)
    return _gather(x, group, counter)


def _gather(x: Tensor, group: dist.ProcessGroup, counter: BytesSent) -> Tensor:
    world = dist.get_world_size(group)
    x = x.contiguous()
    out = x.new_empty((world * x.shape[0], *x.shape[1:]))
    dist.all_gather_into_tensor(out, x, group=group)  # gloo gathers along dim 0 only
    counter.forward += (world - 1) * x.numel() * x.element_size()
    return out


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup, counter: BytesSent) -> Tensor:
        ctx.group, ctx.counter = group, counter
        return _gather(x, group, counter)

    @staticmethod
    def backward(ctx, grad: Tensor):
        world = dist.get_world_size(ctx.group)
        out = grad.new_empty((grad.shape[0] // world, *grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad.contiguous(), op=dist.ReduceOp.SUM, group=ctx.group)
        ctx.counter.backward += (world - 1) * out.numel() * out.element_size()
        return out, None, None


def sequence_slots(layout: SequenceLayout) -> list[int]:
    """For each chunk in sequence order, its row in a gather of every rank's chunks (rank-major, shard order)."""
    slots = [0] * layout.num_chunks
    for rank in range(layout.cp):
        for position, chunk in enumerate(layout.rank_chunks(rank)):
            slots[chunk] = rank * layout.chunks_per_rank + position
    return slots


def _as_chunks(x: Tensor, per_rank: int) -> Tensor:
    """[b, shard, ...] -> [per_rank * b, shard / per_rank, ...]: the rank's chunks side by side in the batch."""
    return x.unflatten(1, (per_rank, -1)).transpose(0, 1).flatten(0, 1)


def _from_chunks(x: Tensor, per_rank: int) -> Tensor:
    return x.unflatten(0, (per_rank, -1)).transpose(0, 1).flatten(1, 2)


class StatePassingCore:
    """The GDN layer's convolution and rule (the `GatedDeltaCore` methods) over a context-parallel group.

    Inputs are this rank's shards [b, shard_len, ...] cut by `layout`, the one the ring attention of the same
    model uses (`resolve()`, `rank_chunks(rank)`, `chunks_per_rank`, `num_chunks`, `cp`); document_ids [b,
    shard_len] is this rank's shard of the batch's ids."""

    def __init__(self, group: dist.ProcessGroup, layout: Layout, chunk_size: int = 64, fla: ModuleType | None = None):
        self.group = group
        self.fla = fla  # fla's ops where the run's kernel plan chose them for the local pass (meshloom/planning/kernels.py)
        self.layout = layout
        self.chunk_size = chunk_size  # the chunked rule's own chunks inside each context-parallel chunk
        self.rank = dist.get_rank(group)
        self.bytes_sent = BytesSent()
        # The latest batch's gathered document edges by tail width (see _gathered_edges).
        self._edges_key: tuple | None = None
        self._edges: dict[int, Tensor] = {}

    def rule(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
             document_ids: Tensor | None = None) -> Tensor:
        """This rank's rows of `chunk_gated_delta_rule`'s output over the whole sequence, from a zero state."""
        layout = self.layout.resolve()
        per_rank, (b, shard, h, dk), dv = layout.chunks_per_rank, q.shape, v.shape[-1]
        assert shard % per_rank == 0, (shard, per_rank)
        chunks = [_as_chunks(x, per_rank) for x in (q.float(), k, v, g, beta)]
        ids = None if document_ids is None else _as_chunks(document_ids, per_rank)
        start = torch.zeros(per_rank * b, h, dk, dv + dk, device=q.device)
        start[..., dv:] = torch.eye(dk, device=q.device)
        out, final = chunk_gated_delta_rule(*chunks, scale=scale, initial_state=start, document_ids=ids,
                                            chunk_size=self.chunk_size, fla=self.fla)
        # Rank-major, shard order: [cp * per_rank, b, h, dk, dv + dk] = every chunk's [B | T].
        pairs = all_gather_rows(final.unflatten(0, (per_rank, b)), self.group, self.bytes_sent)
        starts_document = None if document_ids is None else self._starts_document(document_ids, layout, 1)
        with torch.autocast(q.device.type, enabled=False):  # the scan and correction stay float32, as the rule
            corrected = self._corrected(out, pairs, starts_document, layout, dv)
        return _from_chunks(corrected, per_rank).to(q.dtype)

    def _corrected(self, out: Tensor, pairs: Tensor, starts_document: Tensor | None, layout: SequenceLayout,
                   dv: int) -> Tensor:
        """The local outputs plus the incoming state's share, R_t S_in(c), from the gathered pairs."""
        b, h, dk = pairs.shape[1], pairs.shape[2], pairs.shape[3]
        # The exclusive scan over every chunk, then this rank's picked from it: the gather then stays in the graph
        # of a rank whose chunks read no earlier state (chunk 0 alone), whose backward must still join the
        # reduce-scatter of the others' gradients.
        states = [torch.zeros(b, h, dk, dv, device=out.device)]
        by_slot = pairs.unbind(0)
        for chunk, slot in enumerate(sequence_slots(layout)[:-1], start=1):
            pair = by_slot[slot]
            state = pair[..., dv:] @ states[-1] + pair[..., :dv]
            if starts_document is not None:
                state = state * (~starts_document[chunk]).float()[:, None, None, None]
            states.append(state)
        incoming = torch.stack(states)  # [num_chunks, b, h, dk, dv]
        mine = list(layout.rank_chunks(self.rank))
        incoming_states = incoming[mine].flatten(0, 1)  # [per_rank * b, h, dk, dv]
        return out[..., :dv] + torch.einsum("nshk,nhkv->nshv", out[..., dv:], incoming_states)

    def conv(self, x: Tensor, weight: Tensor, document_ids: Tensor | None = None) -> Tensor:
        """This rank's rows of `causal_depthwise_conv` over the whole sequence (no history before its start)."""
        layout = self.layout.resolve()
        per_rank, (b, shard, channels), width = layout.chunks_per_rank, x.shape, weight.shape[-1]
        chunk_len = shard // per_rank
        tail = min(width - 1, chunk_len)
        chunks = _as_chunks(x, per_rank)
        tails = all_gather_rows(chunks[:, chunk_len - tail:].unflatten(0, (per_rank, b)), self.group, self.bytes_sent)
        ordered = tails[sequence_slots(layout)]  # [num_chunks, b, tail, channels]
        # A chunk's history: the last K - 1 tokens of the chunks before it (zeros before the sequence), since a chunk
        # shorter than K - 1 tokens leaves part of the history to the chunk before that.
        flat = torch.cat([x.new_zeros(b, width - 1, channels), ordered.permute(1, 0, 2, 3).flatten(1, 2)], dim=1)
        mine = layout.rank_chunks(self.rank)
        history = torch.cat([flat[:, c * tail: c * tail + width - 1] for c in mine])
        ids = history_ids = None
        if document_ids is not None:
            ids = _as_chunks(document_ids, per_rank)
            edges = self._gathered_edges(document_ids, layout, tail)[:, :, 1:]  # [num_chunks, b, tail]
            flat_ids = torch.cat([edges[0, :, :1].expand(b, width - 1), edges.permute(1, 0, 2).flatten(1)], dim=1)
            history_ids = torch.cat([flat_ids[:, c * tail: c * tail + width - 1] for c in mine])
        out = causal_depthwise_conv(chunks, weight, history=history, document_ids=ids,
                                    history_document_ids=history_ids)
        return _from_chunks(out, per_rank)

    def _gathered_edges(self, document_ids: Tensor, layout: SequenceLayout, tail: int) -> Tensor:
        """Every chunk's first id and last `tail` ids, in sequence order: int [num_chunks, b, 1 + tail].

        Every layer of a forward sees the same ids tensor: gathered once per batch (and width), not per layer. Every
        rank of the group calls this in the same order with the same batch, so they all gather (or not) together."""
        if self._edges_key is None or self._edges_key[0] is not document_ids or self._edges_key[1] != layout:
            self._edges_key, self._edges = (document_ids, layout), {}
        if tail not in self._edges:
            per_rank, b = layout.chunks_per_rank, document_ids.shape[0]
            chunks = _as_chunks(document_ids, per_rank)
            local = torch.cat([chunks[:, :1], chunks[:, chunks.shape[1] - tail:]], dim=1).unflatten(0, (per_rank, b))
            self._edges[tail] = _gather(local, self.group, self.bytes_sent)[sequence_slots(layout)]
        return self._edges[tail]

    def _starts_document(self, document_ids: Tensor, layout: SequenceLayout, tail: int) -> Tensor:
        """bool [num_chunks, b]: the chunk's first token starts a document (its id differs from the token before)."""
        edges = self._gathered_edges(document_ids, layout, tail)
        starts = torch.zeros(edges.shape[:2], dtype=torch.bool, device=edges.device)
        starts[1:] = edges[1:, :, 0] != edges[:-1, :, -1]
        return starts

    def __repr__(self) -> str:
        return f"StatePassingCore(cp={dist.get_world_size(self.group)}, layout={self.layout!r})"
