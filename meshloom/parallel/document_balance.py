"""Document-aware context-parallel balancing: chunks of each batch go to the cp ranks by attention work.

Head-tail balancing equalises the work of a causal mask, where a query at position t sees t + 1 keys. With packed
documents and a document mask a query sees only the earlier keys of its own document, so the work of a chunk
depends on where the documents fall: a chunk inside one long document costs much more than a chunk of many short
ones. Here every batch's sequence is cut into `chunks_per_rank` x cp equal chunks, each chunk's work (the visible
(query, key) pairs of its queries, summed over the batch) is counted from the document ids, and the chunks are
dealt to the ranks, heaviest first, each to the least-loaded rank that still has room, then improved by swaps
between the most and least loaded ranks. Every rank of the cp group holds the whole batch before sharding, so all
of them compute the same assignment without talking.

The layout changes from batch to batch: the batch sharder sets it (`plan`), and the ring attention, the RoPE
positions hook and the sequence shift of multi-token prediction read the current one (`resolve`), so inputs,
labels, positions and masks always agree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from meshloom.parallel.sequence_layout import Layout, SequenceLayout

# Swap passes after the greedy deal; each moves work from the most to the least loaded rank.
_MAX_SWAPS = 64


def visible_keys(document_ids: torch.Tensor | None, seq_len: int) -> torch.Tensor:
    """Keys each query position sees under the (document) causal mask, summed over the batch: int64 [seq_len].

    Without document ids the mask is plain causal. Documents are the runs of equal ids, as the data loader numbers
    them (each packed document has its own id)."""
    positions = torch.arange(seq_len, dtype=torch.int64)
    if document_ids is None:
        return positions + 1
    ids = document_ids.detach().to("cpu", torch.int64)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    first = torch.where(starts, positions, 0).cummax(dim=1).values  # where each position's document began
    return (positions - first + 1).sum(0)


def chunk_costs(document_ids: torch.Tensor | None, seq_len: int, num_chunks: int) -> list[int]:
    """Visible (query, key) pairs of each of `num_chunks` equal chunks' queries: their attention FLOPs up to a
    constant."""
    return visible_keys(document_ids, seq_len).view(num_chunks, -1).sum(1).tolist()


def rank_loads(costs: list[int], layout: SequenceLayout) -> list[int]:
    return [sum(costs[c] for c in layout.rank_chunks(r)) for r in range(layout.cp)]


def attention_imbalance(costs: list[int], layout: SequenceLayout) -> float:
    """Largest over mean attention work of the cp ranks under `layout` (1.0 = perfectly balanced)."""
    loads = rank_loads(costs, layout)
    return max(loads) * len(loads) / max(1, sum(loads))


def assign_chunks(costs: list[int], cp: int) -> tuple[tuple[int, ...], ...]:
    """Equal numbers of chunks per rank with the largest rank load as small as the heuristic finds: a greedy deal,
    heaviest chunk first to the least-loaded rank with room, then swaps between the most and least loaded ranks
    while one lowers the larger of their two loads. Deterministic (ties go to lower indices)."""
    per_rank = len(costs) // cp
    assert per_rank * cp == len(costs), (len(costs), cp)
    owned: list[list[int]] = [[] for _ in range(cp)]
    loads = [0] * cp
    for chunk in sorted(range(len(costs)), key=lambda c: (-costs[c], c)):
        rank = min((r for r in range(cp) if len(owned[r]) < per_rank), key=lambda r: (loads[r], r))
        owned[rank].append(chunk)
        loads[rank] += costs[chunk]
    for _ in range(_MAX_SWAPS):
        hi = max(range(cp), key=lambda r: (loads[r], -r))
        lo = min(range(cp), key=lambda r: (loads[r], r))
        best = None
        for a in owned[hi]:
            for b in owned[lo]:
                moved = costs[a] - costs[b]
                if 0 < moved < loads[hi] - loads[lo]:
                    worst = max(loads[hi] - moved, loads[lo] + moved)
                    if best is None or worst < best[0]:
                        best = (worst, a, b, moved)
        if best is None:
            break
        _, a, b, moved = best
        owned[hi][owned[hi].index(a)] = b
        owned[lo][owned[lo].index(b)] = a
        loads[hi] -= moved
        loads[lo] += moved
    return tuple(tuple(sorted(chunks)) for chunks in owned)


class DocumentBalancedLayout:
    """The layout of one cp group that the batch sharder re-plans for every batch (see the module docstring)."""

    load_balance = True

    def __init__(self, cp: int, chunks_per_rank: int):
        self.cp = cp
        self._chunks_per_rank = chunks_per_rank
        # Before the first batch: the plain causal mask's assignment.
        self.current = SequenceLayout(cp, assignment=assign_chunks(list(range(1, cp * chunks_per_rank + 1)), cp))

    @property
    def chunks_per_rank(self) -> int:
        return self._chunks_per_rank

    @property
    def num_chunks(self) -> int:
        return self.cp * self._chunks_per_rank

    def plan(self, costs: list[int]) -> SequenceLayout:
        """Set (and return) the layout for a batch whose chunks cost `costs` (see `chunk_costs`)."""
        self.current = SequenceLayout(self.cp, assignment=assign_chunks(costs, self.cp))
        return self.current

    def resolve(self) -> SequenceLayout:
        return self.current

    def check_seq_len(self, seq_len: int) -> None:
        self.current.check_seq_len(seq_len)

    def rank_chunks(self, rank: int) -> tuple[int, ...]:
        return self.current.rank_chunks(rank)

    def positions(self, seq_len: int, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
        return self.current.positions(seq_len, rank, device)

    def shard(self, tensor: torch.Tensor, rank: int, dim: int = 1) -> torch.Tensor:
        return self.current.shard(tensor, rank, dim)

    def visible_blocks(self, q_rank: int, kv_rank: int, shard_len: int) -> Iterator[tuple[slice, slice, bool]]:
        return self.current.visible_blocks(q_rank, kv_rank, shard_len)

    def __repr__(self) -> str:
        return f"DocumentBalancedLayout(cp={self.cp}, chunks_per_rank={self._chunks_per_rank})"


# One per-batch layout per cp process group: the batch sharder and the model's ring attention, positions and
# sequence shift must all read the same object.
_SHARED: dict[Any, DocumentBalancedLayout] = {}


def planned_layout(cp: int, parallelism: Any) -> Layout:
    """The sequence layout the parallelism settings ask for, built without a process group (for checks)."""
    if cp == 1 or not parallelism.cp_document_balance:
        return SequenceLayout(cp, parallelism.cp_load_balance)
    return DocumentBalancedLayout(cp, parallelism.cp_document_chunks)


def context_layout(dims: Any, parallelism: Any) -> Layout:
    """The sequence layout of this rank's cp group under the parallelism settings (see ParallelismConfig)."""
    if dims.cp == 1 or not parallelism.cp_document_balance:
        return planned_layout(dims.cp, parallelism)
    group = dims.mesh("cp").get_group()
    if group not in _SHARED:
        _SHARED[group] = DocumentBalancedLayout(dims.cp, parallelism.cp_document_chunks)
    return _SHARED[group]


class BatchSharder:
    """A batch (a dataclass with `inputs`, `labels` and optional `document_ids` [b, s]) to this rank's sequence
    shard of it.

    Every per-token field is cut at the same positions, so each local token keeps its own next-token target.
    Without context parallel the batch passes through unchanged. A per-batch layout (`plan(document_ids)`) is set
    from the whole batch first, which every rank of the cp group holds, so all of them choose the same one.
    `metrics()` reports the attention-work imbalance of the shards cut since the last call.
    """

    def __init__(self, layout: Layout | None, rank: int = 0):
        self.layout = layout
        self.rank = rank
        self._imbalances: list[float] = []

    def __call__(self, batch: Any) -> Any:
        if self.layout is None:
            return batch
        seq_len = batch.inputs.shape[1]
        plan = getattr(self.layout, "plan", None)
        costs = chunk_costs(batch.document_ids, seq_len, self.layout.num_chunks)
        layout = plan(costs) if plan is not None else self.layout.resolve()
        self._imbalances.append(attention_imbalance(costs, layout))
        per_token = {name: getattr(batch, name) for name in ("inputs", "labels", "document_ids")}
        return dataclasses.replace(
            batch, **{name: layout.shard(value, self.rank) for name, value in per_token.items() if value is not None}
        )

    def metrics(self) -> dict[str, float]:
        """Largest over mean attention work (visible query-key pairs) of the cp ranks, averaged over batches."""
        if not self._imbalances:
            return {}
        value = sum(self._imbalances) / len(self._imbalances)
        self._imbalances.clear()
        return {"cp_attention_imbalance": value}


def batch_sharder(dims: Any, layout: Layout) -> BatchSharder:
    """This rank's BatchSharder under `layout` (a pass-through without context parallel)."""
    if dims.cp == 1:
        return BatchSharder(None)
    return BatchSharder(layout, dims.mesh("cp").get_local_rank())
