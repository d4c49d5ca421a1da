"""The attention blocks a rank computes in the context-parallel ring, with causal and document masks.

For each key/value shard visiting a rank, the work is a few (query chunk, key chunk) blocks: a key chunk earlier
in the sequence than the query chunk is visible, the same chunk is causal on its diagonal, a later one is hidden.
With document ids a query also sees only keys of its own document, so a block is cut down to the rectangle of
query rows and keys that share a document (usually the tail of one document running across a chunk boundary),
and skipped when they share none. What remains carries an explicit boolean mask only where the rectangle is not
all visible. Rows of a block that see no key at all get an output of zero and a log-sum-exp of -inf, which the
merge handles (see `context.merge_partial`); every query sees at least itself on its own diagonal block.

A sliding window (a query at position i sees keys j with i - j < window) cuts blocks the same way, from the
global positions of the block's rows and keys: key chunks wholly behind the window are skipped, and the blocks at
its edge carry the band as their mask (together with the documents when both are on).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from meshloom.parallel.sequence_layout import SequenceLayout


@dataclass(frozen=True)
class Block:
    rows: slice  # query rows of this rank's shard
    keys: slice  # key rows of the visiting shard
    causal: bool  # rows and keys are the same chunk: row i sees keys 0..i
    mask: torch.Tensor | None  # [b, rows, keys] bool, True = may attend; None = all visible (up to `causal`)


def _span(flags: torch.Tensor) -> tuple[int, int] | None:
    """(first, end) of the True entries of a 1-D bool tensor, or None."""
    where = flags.nonzero()
    if where.numel() == 0:
        return None
    return int(where[0]), int(where[-1]) + 1


def _document_block(rows: slice, keys: slice, causal: bool, q_docs: torch.Tensor, kv_docs: torch.Tensor) -> Block | None:
    return _masked_block(rows, keys, causal, q_docs[:, rows, None] == kv_docs[:, None, keys])


def _masked_block(rows: slice, keys: slice, causal: bool, visible: torch.Tensor) -> Block | None:
    """The block cut to the rows and keys that `visible` [b, rows, keys] (beyond the causal diagonal) lets meet."""
    if causal:
        # The diagonal keeps its shape (tiles trim keys past their last row); the mask adds the documents.
        tril = torch.ones(visible.shape[1:], dtype=torch.bool, device=visible.device).tril()
        return Block(rows, keys, True, None if bool(visible.all()) else visible & tril)
    row_span, key_span = _span(visible.any(2).any(0)), _span(visible.any(1).any(0))
    if row_span is None or key_span is None:
        return None
    (r0, r1), (k0, k1) = row_span, key_span
    visible = visible[:, r0:r1, k0:k1]
    rows, keys = slice(rows.start + r0, rows.start + r1), slice(keys.start + k0, keys.start + k1)
    return Block(rows, keys, False, None if bool(visible.all()) else visible)


class RingBlocks:
    """The blocks this rank computes for each visiting shard's owner, built once per batch and layout.

    `documents` [cp, b, shard_len] are every rank's document ids (None = the causal mask alone); `window` a sliding
    window in tokens (None = every earlier key), its masks made on `device`."""

    def __init__(
        self,
        layout: SequenceLayout,
        rank: int,
        shard_len: int,
        documents: torch.Tensor | None,
        window: int | None = None,
        device: torch.device | str | None = None,
    ):
        self.layout, self.rank, self.shard_len, self.documents, self.window = layout, rank, shard_len, documents, window
        self.device = documents.device if documents is not None else device
        self._by_owner: dict[int, list[Block]] = {}

    def _visible(self, rows: slice, keys: slice, owner: int) -> torch.Tensor:
        """[b or 1, rows, keys]: the pairs the documents and the window allow (the causal diagonal aside)."""
        if self.documents is not None:
            visible = self.documents[self.rank][:, rows, None] == self.documents[owner][:, None, keys]
        else:
            visible = torch.ones(1, rows.stop - rows.start, keys.stop - keys.start, dtype=torch.bool, device=self.device)
        if self.window is not None:
            seq_len = self.shard_len * self.layout.cp
            q_pos = self.layout.positions(seq_len, self.rank, visible.device)[rows]
            k_pos = self.layout.positions(seq_len, owner, visible.device)[keys]
            visible = visible & (q_pos[:, None] - k_pos[None, :] < self.window)
        return visible

    def __call__(self, owner: int) -> list[Block]:
        if owner not in self._by_owner:
            blocks = []
            for rows, keys, causal in self.layout.visible_blocks(self.rank, owner, self.shard_len):
                if self.documents is None and self.window is None:
                    blocks.append(Block(rows, keys, causal, None))
                elif (block := _masked_block(rows, keys, causal, self._visible(rows, keys, owner))):
                    blocks.append(block)
            self._by_owner[owner] = blocks
        return self._by_owner[owner]


def gather_documents(document_ids: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every cp rank's document ids [cp, b, shard_len] (a few integers per token, once per batch)."""
    local = document_ids.contiguous()
    world = dist.get_world_size(group)
    gathered = local.new_empty((world * local.shape[0], *local.shape[1:]))  # gloo gathers along dim 0 only
    dist.all_gather_into_tensor(gathered, local, group=group)
    return gathered.view(world, *local.shape)


class BlockCache:
    """RingBlocks of the latest batch: every layer of a forward (and its backward) sees the same document ids
    tensor, so the ids are gathered and the masks built once, not once per layer (once per window size when layers
    differ in their windows). Every rank of the ring calls it in the same order with the same tensors, so they all
    gather (or not) together."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self._key: tuple | None = None
        self._blocks: dict[int | None, RingBlocks] = {}

    def get(
        self,
        layout: SequenceLayout,
        shard_len: int,
        document_ids: torch.Tensor | None,
        window: int | None = None,
        device: torch.device | str | None = None,
    ) -> RingBlocks:
        key = (document_ids, layout, shard_len)
        if self._key is None or self._key[0] is not document_ids or self._key[1:] != key[1:]:
            documents = None if document_ids is None else gather_documents(document_ids, self.group)
            self._key, self._blocks = key, {None: RingBlocks(layout, dist.get_rank(self.group), shard_len, documents)}
        if window not in self._blocks:
            rank, documents = dist.get_rank(self.group), self._blocks[None].documents
            self._blocks[window] = RingBlocks(layout, rank, shard_len, documents, window, device)
        return self._blocks[window]
