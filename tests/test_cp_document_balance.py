"""Document masks under context parallel, in one process: the work model, the document-aware assignment, the
per-batch layout the sharder sets, and blocks whose rows see no key (the multi-rank ring is in
test_context_parallel.py, training parity in test_context_parallel_documents.py)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from meshloom.parallel import context
from meshloom.parallel.document_balance import (
    BatchSharder,
    DocumentBalancedLayout,
    assign_chunks,
    attention_imbalance,
    chunk_costs,
    visible_keys,
)
from meshloom.parallel.ring_blocks import RingBlocks
from meshloom.parallel.sequence_layout import SequenceLayout, positions_hook


def _ids(*lengths_per_row: list[int]) -> torch.Tensor:
    return torch.stack([torch.repeat_interleave(torch.arange(len(d)), torch.tensor(d)) for d in lengths_per_row])


def _mask(ids: torch.Tensor) -> torch.Tensor:
    return (ids[:, :, None] == ids[:, None, :]).tril()


def test_visible_keys_count_the_document_causal_mask():
    ids = _ids([5, 1, 10], [16])
    assert torch.equal(visible_keys(ids, 16), _mask(ids).sum(2).sum(0))
    assert visible_keys(None, 4).tolist() == [1, 2, 3, 4]
    assert sum(chunk_costs(ids, 16, 4)) == int(_mask(ids).sum())


def test_document_aware_assignment_balances_where_head_tail_does_not():
    # Many short documents, then one long one: the work sits in the last quarter of the sequence.
    ids = _ids([4] * 24 + [160])
    costs = chunk_costs(ids, 256, 16)
    assignment = assign_chunks(costs, 4)
    assert sorted(c for chunks in assignment for c in chunks) == list(range(16))
    assert all(len(chunks) == 4 for chunks in assignment)
    head_tail = attention_imbalance(chunk_costs(ids, 256, 8), SequenceLayout(4, True))
    balanced = attention_imbalance(costs, SequenceLayout(4, assignment=assignment))
    assert head_tail > 1.4 and balanced < 1.1, (head_tail, balanced)
    assert assign_chunks(costs, 4) == assignment  # every rank computes the same one
    # Under a plain causal mask head-tail is exact, and the assignment is no worse.
    causal = chunk_costs(None, 256, 16)
    assert attention_imbalance(chunk_costs(None, 256, 8), SequenceLayout(4, True)) == 1.0
    assert attention_imbalance(causal, SequenceLayout(4, assignment=assign_chunks(causal, 4))) <= 1.01


@dataclass
class _Batch:
    inputs: torch.Tensor
    labels: torch.Tensor
    document_ids: torch.Tensor | None


def test_sharder_sets_the_batch_layout_that_positions_and_blocks_follow():
    layout = DocumentBalancedLayout(cp=2, chunks_per_rank=4)
    hook = positions_hook(layout, rank=1, seq_len=32)
    tokens = torch.arange(33).repeat(2, 1)
    ids = _ids([2, 2, 2, 2, 23, 1], [32])
    shards = [BatchSharder(layout, rank)(_Batch(tokens[:, :-1], tokens[:, 1:], ids)) for rank in range(2)]
    current = layout.resolve()
    assert current.assignment == assign_chunks(chunk_costs(ids, 32, 8), 2)
    _, kwargs = hook(None, (shards[1].inputs,), {})
    # Inputs, labels, document ids and RoPE positions are cut at the same places.
    assert torch.equal(shards[1].inputs[0], kwargs["positions"])
    assert torch.equal(shards[1].labels, shards[1].inputs + 1)
    assert torch.equal(shards[1].document_ids, ids[:, kwargs["positions"]])
    assert BatchSharder(layout, 0).metrics() == {}
    sharder = BatchSharder(SequenceLayout(2, True), 0)
    sharder(_Batch(tokens[:, :-1], tokens[:, 1:], ids))
    expected = attention_imbalance(chunk_costs(ids, 32, 4), SequenceLayout(2, True))
    assert sharder.metrics() == {"cp_attention_imbalance": expected} and expected > 1
    assert sharder.metrics() == {}  # reported once
    # A later batch with other documents gets its own layout, and the hook follows it.
    other = _ids([32], [32])
    BatchSharder(layout, 1)(_Batch(tokens[:, :-1], tokens[:, 1:], other))
    assert layout.resolve().assignment == assign_chunks(chunk_costs(other, 32, 8), 2)
    assert torch.equal(hook(None, (shards[1].inputs,), {})[1]["positions"], layout.positions(32, 1))


def test_blocks_are_cut_to_shared_documents_and_skipped_without_any():
    layout = SequenceLayout(2, False)  # rank 1 holds positions 8..15, rank 0 positions 0..7
    ids = _ids([6, 4, 6])  # documents 0..5, 6..9, 10..15
    documents = torch.stack([layout.shard(ids, r) for r in range(2)])
    (block,) = RingBlocks(layout, 1, 8, documents)(0)
    # Queries 8, 9 (document 1) see keys 6, 7 only; documents 0 and 2 share nothing across the cut.
    assert (block.rows, block.keys, block.causal, block.mask) == (slice(0, 2), slice(6, 8), False, None)
    one_doc = torch.zeros(1, 1, 8, dtype=torch.long)  # [cp, b, shard]: rank 0 holds document 0, rank 1 document 1
    assert RingBlocks(layout, 1, 8, torch.cat([one_doc, one_doc + 1]))(0) == []


def test_rows_that_see_no_key_merge_without_nan():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 5)
    mask = torch.tensor([[True] * 4, [False] * 4, [True, False, True, False], [False] * 4])[None]
    out, lse = context.block_attention(q, k, v, 8**-0.5, False, mask)
    assert torch.isneginf(lse[:, :, [1, 3]]).all() and torch.equal(out[:, :, [1, 3]], torch.zeros(1, 2, 2, 5))
    running_out, running_lse = torch.zeros(1, 2, 4, 5), torch.full((1, 2, 4), float("-inf"))
    context.merge_partial(running_out, running_lse, out, lse)
    context.merge_partial(running_out, running_lse, out, lse)  # the same keys twice: same softmax, lse + log 2
    assert not running_out.isnan().any()
    assert torch.allclose(running_out, out) and torch.isneginf(running_lse[:, :, [1, 3]]).all()
    reference = torch.nn.functional.scaled_dot_product_attention(q[:, :, [0, 2]], k, v, attn_mask=mask[:, None, [0, 2]])
    assert torch.allclose(out[:, :, [0, 2]], reference, atol=1e-6)
    # Backward with the final lse: hidden keys get no gradient and nothing is NaN.
    grad = torch.randn(1, 2, 4, 5)
    final_lse = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    delta = (grad * out).sum(-1)
    dq, dk, dv = context.block_attention_backward(q, k, v, grad, final_lse, delta, 8**-0.5, False, mask)
    assert not any(t.isnan().any() for t in (dq, dk, dv))
    assert torch.equal(dq[:, :, [1, 3]], torch.zeros(1, 2, 2, 8))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_ring_blocks_of_every_rank_give_document_masked_attention(device):
    """The ring's work for each query rank, played in one process (the hops become a loop over owners): the
    document-cut blocks merged by log-sum-exp equal SDPA with the full block-diagonal causal mask, with MLA's
    larger v head, on CPU and on CUDA."""
    torch.manual_seed(0)
    ids = _ids([1, 5, 2, 20, 3, 1, 32], [64]).to(device)
    q, k = torch.randn(2, 2, 64, 8, device=device), torch.randn(2, 2, 64, 8, device=device)
    v = torch.randn(2, 2, 64, 12, device=device)
    reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=_mask(ids)[:, None])
    costs = chunk_costs(ids, 64, 16)
    for layout in (SequenceLayout(4, True), SequenceLayout(4, assignment=assign_chunks(costs, 4))):
        documents = torch.stack([layout.shard(ids, r) for r in range(4)])
        for rank in range(4):
            blocks = RingBlocks(layout, rank, 16, documents)
            qs = layout.shard(q, rank, dim=2)
            out = torch.zeros(2, 2, 16, 12, device=device)
            lse = torch.full((2, 2, 16), float("-inf"), device=device)
            for owner in range(4):
                ks, vs = layout.shard(k, owner, dim=2), layout.shard(v, owner, dim=2)
                for b in blocks(owner):
                    block_out, block_lse = context.block_attention(
                        qs[:, :, b.rows], ks[:, :, b.keys], vs[:, :, b.keys], 8**-0.5, b.causal, b.mask
                    )
                    context.merge_partial(out[:, :, b.rows], lse[:, :, b.rows], block_out, block_lse)
            torch.testing.assert_close(out, layout.shard(reference, rank, dim=2), atol=1e-5, rtol=1e-5)
