"""Shifting a context-parallel sequence shard along the whole sequence (multi-token prediction's labels).

Each rank of a cp group holds some chunks of every sequence (see `meshloom.parallel.context.SequenceLayout`), so
the tokens a few places past the end of a chunk live on another rank. They are a handful per chunk: all ranks
exchange the first k tokens of each of their chunks in one all-gather, and each rank then builds its shifted shard.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshloom.config.errors import UserError
from meshloom.parallel.context import SequenceLayout


class ShardedSequenceShift:
    """Moves a sharded sequence k positions to the left, as `shift_left` moves a whole one: each rank gets, at its
    own positions, the tokens k places further on, the k past a chunk's end taken from the rank holding the next
    chunk (all ranks exchange the first k tokens of their chunks); the sequence's last k positions hold `fill`.

    For values that follow the input tokens without gradient, such as labels shifted for multi-token prediction.
    """

    def __init__(self, group: dist.ProcessGroup, layout: SequenceLayout):
        self.group = group
        self.layout = layout
        self.rank = dist.get_rank(group)

    def __call__(self, tokens: torch.Tensor, k: int, fill: int) -> torch.Tensor:
        if k == 0:
            return tokens
        layout = self.layout
        chunk = tokens.shape[1] // layout.chunks_per_rank
        if k > chunk:
            raise UserError(
                f"a shift of {k} positions crosses more than one sequence chunk of {chunk} tokens under context "
                f"parallel (cp={layout.cp}); use longer sequences or fewer cp ranks"
            )
        chunks = tokens.unflatten(1, (layout.chunks_per_rank, chunk)).transpose(0, 1)  # [chunks, b, chunk]
        heads = chunks[:, :, :k].contiguous()
        gathered = heads.new_empty((layout.cp * layout.chunks_per_rank, *heads.shape[1:]))
        dist.all_gather_into_tensor(gathered, heads, group=self.group)
        owner_order = [c for rank in range(layout.cp) for c in layout.rank_chunks(rank)]
        head_of = {c: gathered[i] for i, c in enumerate(owner_order)}
        shifted = []
        for j, c in enumerate(layout.rank_chunks(self.rank)):
            tail = head_of[c + 1] if c + 1 < layout.num_chunks else torch.full_like(heads[j], fill)
            shifted.append(torch.cat((chunks[j][:, k:], tail), dim=1))
        return torch.cat(shifted, dim=1)

    def __repr__(self) -> str:
        return f"ShardedSequenceShift(cp={self.layout.cp}, load_balance={self.layout.load_balance})"
