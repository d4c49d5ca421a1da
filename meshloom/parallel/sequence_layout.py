"""Which chunks of each sequence a context-parallel rank holds, and cutting batches and RoPE positions to match.

The sequence is cut into equal chunks and every rank of the cp group holds the same number of them:
- contiguous: cp chunks, rank r holds chunk r (under a causal mask the last rank does cp times the first's work);
- head-tail ("zigzag", `load_balance`): 2*cp chunks, rank r holds chunks r and 2*cp-1-r, which equalises the
  causal mask's work;
- an explicit `assignment`, such as the per-batch document-aware one of `meshloom.parallel.document_balance`
  (with packed documents the work per chunk depends on where the documents fall, not only on position).

Inputs, labels, document ids and RoPE positions are all cut by the same layout, so each rank's token losses are
exactly the unsharded ones and the mean over the cp group is the unsharded mean.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from meshloom.config.errors import UserError


@dataclass(frozen=True)
class SequenceLayout:
    """Which chunks of a sequence each of the `cp` ranks holds (see the module docstring)."""

    cp: int
    load_balance: bool = True
    # Chunk indices held by each rank (equal counts per rank), in shard order; set, it overrides load_balance.
    assignment: tuple[tuple[int, ...], ...] | None = None

    @property
    def chunks_per_rank(self) -> int:
        if self.assignment is not None:
            return len(self.assignment[0])
        return 2 if self.load_balance else 1

    @property
    def num_chunks(self) -> int:
        return self.cp * self.chunks_per_rank

    def resolve(self) -> SequenceLayout:
        """The fixed layout in force now (a per-batch layout returns its current one)."""
        return self

    def check_seq_len(self, seq_len: int) -> None:
        if seq_len % self.num_chunks:
            if self.assignment is not None:
                mode = f"the document-aware split ({self.chunks_per_rank} chunks per rank)"
            else:
                mode = "the load-balanced split (2 chunks per rank)" if self.load_balance else "the contiguous split"
            raise UserError(
                f"a sequence of {seq_len} tokens cannot be cut into {self.num_chunks} equal chunks for {mode} "
                f"over cp={self.cp} ranks; use a length divisible by {self.num_chunks}"
            )

    def rank_chunks(self, rank: int) -> tuple[int, ...]:
        """Global chunk indices held by `rank`, in the order they appear in its shard."""
        if self.assignment is not None:
            return self.assignment[rank]
        if self.load_balance:
            return (rank, self.num_chunks - 1 - rank)
        return (rank,)

    def positions(self, seq_len: int, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Positions in the full sequence of `rank`'s tokens, in shard order (int64, [seq_len // cp])."""
        self.check_seq_len(seq_len)
        chunk = seq_len // self.num_chunks
        return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in self.rank_chunks(rank)])

    def shard(self, tensor: torch.Tensor, rank: int, dim: int = 1) -> torch.Tensor:
        """`rank`'s shard of a full-sequence tensor along `dim`."""
        return tensor.index_select(dim, self.positions(tensor.shape[dim], rank, tensor.device))

    def visible_blocks(self, q_rank: int, kv_rank: int, shard_len: int) -> Iterator[tuple[slice, slice, bool]]:
        """(query rows, key rows, causal) of every chunk pair in which some query sees some key.

        A key chunk earlier than the query chunk is fully visible; the same chunk is causal on its diagonal;
        a later chunk is hidden and skipped.
        """
        chunk = shard_len // self.chunks_per_rank
        for i, q_chunk in enumerate(self.rank_chunks(q_rank)):
            for j, kv_chunk in enumerate(self.rank_chunks(kv_rank)):
                if kv_chunk <= q_chunk:
                    yield slice(i * chunk, (i + 1) * chunk), slice(j * chunk, (j + 1) * chunk), kv_chunk == q_chunk


class Layout(Protocol):
    """A SequenceLayout, or an object that holds a different one per batch (`resolve()` gives the current one)."""

    cp: int

    @property
    def chunks_per_rank(self) -> int: ...

    @property
    def num_chunks(self) -> int: ...

    def resolve(self) -> SequenceLayout: ...

    def rank_chunks(self, rank: int) -> tuple[int, ...]: ...


def positions_hook(layout: Layout, rank: int, seq_len: int) -> Callable:
    """A forward pre-hook (with kwargs) that passes this rank's RoPE `positions` to a model's forward.

    The positions follow from the configured sequence length rather than the input's shape, because a later
    pipeline stage may receive hidden states that tensor parallel has sharded further along the sequence. A
    per-batch layout is resolved at every call, so the positions always match the batch's shards.
    """
    shard_len = seq_len // layout.cp
    on_device: dict[tuple[SequenceLayout, torch.device], torch.Tensor] = {}

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if kwargs.get("positions") is not None:
            return args, kwargs
        first = args[0] if args else next(iter(kwargs.values()))
        if first.ndim == 2 and first.shape[1] != shard_len:
            raise UserError(
                f"context parallel was set up for sequences of {seq_len} tokens ({shard_len} per rank), "
                f"but this rank got {first.shape[1]} tokens; shard the batch with its layout first"
            )
        key = (layout.resolve(), first.device)
        if key not in on_device:
            if len(on_device) > 64:  # per-batch layouts: keep the cache small
                on_device.clear()
            on_device[key] = key[0].positions(seq_len, rank, first.device)
        return args, {**kwargs, "positions": on_device[key]}

    return hook
