"""Context parallel: sequence layouts, blockwise attention math, bad input, and ring attention against full attention.

The ring tests run real gloo processes: one launch per world size (2 and 4, testing/ranks.py) runs every case.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from meshloom.config import ConfigError, load_config
from meshloom.models.llama3 import Transformer
from meshloom.models.registry import get_model_args
from meshloom.parallel import context
from meshloom.parallel.context import SequenceLayout, block_attention, block_attention_backward, merge_partial
from meshloom.parallel.document_balance import assign_chunks, chunk_costs
from meshloom.testing.ranks import run_ranks

TOLERANCE = 1e-5
BF16_TOLERANCE = 2e-2
# (name, load_balance, dtype, score tile elements, inside bf16 autocast): the tiny tile forces many query tiles
# per block; under autocast the ring must still compute float32 inputs in float32.
CASES = [
    ("balanced", True, torch.float32, context.SCORE_TILE_ELEMENTS, False),
    ("unbalanced", False, torch.float32, context.SCORE_TILE_ELEMENTS, False),
    ("balanced_tiled", True, torch.float32, 2 * 4 * 3 * 16, False),
    ("balanced_autocast", True, torch.float32, context.SCORE_TILE_ELEMENTS, True),
    ("balanced_bf16", True, torch.bfloat16, context.SCORE_TILE_ELEMENTS, False),
]
# Document masks: (name, layout, v head size, score tile elements, key/value heads). "document" is the
# document-aware assignment of the batch's chunks (4 per rank); a v head size of 24 against q/k's 16 is MLA's shape;
# 2 key/value heads for 4 query heads is grouped-query attention, whose heads the ring carries unexpanded.
DOCUMENT_CASES = [
    ("documents", "balanced", 16, context.SCORE_TILE_ELEMENTS, 4),
    ("documents_contiguous", "contiguous", 16, context.SCORE_TILE_ELEMENTS, 4),
    ("documents_tiled", "balanced", 16, 2 * 4 * 3 * 16, 4),
    ("documents_mla", "balanced", 24, context.SCORE_TILE_ELEMENTS, 4),
    ("documents_assigned", "document", 24, context.SCORE_TILE_ELEMENTS, 4),
    ("documents_grouped_kv", "balanced", 16, 2 * 4 * 3 * 16, 2),
]
# Two packed sequences of 64 tokens: one-token documents, short ones, and one running across several chunks;
# the second sequence is one document. Equal ids = the same document.
DOCUMENT_LENGTHS = [[1, 1, 3, 7, 30, 2, 1, 19], [64]]


# ---------------------------------------------------------------------------
# Single process
# ---------------------------------------------------------------------------


def test_layouts_cover_the_sequence_once_and_balance_causal_work():
    balanced, contiguous = SequenceLayout(2, True), SequenceLayout(2, False)
    assert balanced.positions(8, 0).tolist() == [0, 1, 6, 7]
    assert balanced.positions(8, 1).tolist() == [2, 3, 4, 5]
    assert contiguous.positions(8, 1).tolist() == [4, 5, 6, 7]
    for layout in (SequenceLayout(4, True), SequenceLayout(4, False)):
        seen = torch.cat([layout.positions(64, r) for r in range(4)])
        assert sorted(seen.tolist()) == list(range(64))

    def visible_pairs(layout: SequenceLayout, rank: int, shard_len: int) -> int:
        # (query, key) pairs the causal mask lets through, counted over the blocks the ring computes
        total = 0
        for owner in range(layout.cp):
            for rows, keys, causal in layout.visible_blocks(rank, owner, shard_len):
                n_q, n_k = rows.stop - rows.start, keys.stop - keys.start
                total += n_q * (n_q + 1) // 2 if causal else n_q * n_k
        return total

    work = [visible_pairs(SequenceLayout(4, True), r, 16) for r in range(4)]
    assert len(set(work)) == 1 and sum(work) == 64 * 65 // 2
    work = [visible_pairs(SequenceLayout(4, False), r, 16) for r in range(4)]
    # rank r: its own diagonal chunk plus r fully visible earlier chunks
    assert work == [136 + 256 * r for r in range(4)]


def test_shard_keeps_inputs_and_labels_aligned():
    tokens = torch.arange(17).repeat(2, 1)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    layout = SequenceLayout(2, True)
    for rank in range(2):
        assert torch.equal(layout.shard(labels, rank), layout.shard(inputs, rank) + 1)


def test_blocks_merged_by_log_sum_exp_equal_full_attention_forward_and_backward():
    torch.manual_seed(0)
    q, k, v, grad = (torch.randn(2, 3, 12, 8, dtype=torch.float64) for _ in range(4))
    scale = 8**-0.5
    # full causal attention over 12 keys = the causal diagonal block (keys 4..11) + the visible earlier block (0..3)
    qs = q[:, :, 4:]
    out, lse = block_attention(qs, k[:, :, 4:], v[:, :, 4:], scale, causal=True)
    merge_partial(out, lse, *block_attention(qs, k[:, :, :4], v[:, :, :4], scale, causal=False))

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    reference = F.scaled_dot_product_attention(*leaves, is_causal=True)
    reference[:, :, 4:].backward(grad[:, :, 4:])
    assert torch.allclose(out.double(), reference[:, :, 4:].detach(), atol=1e-6)

    delta = (grad[:, :, 4:] * out).sum(-1)
    dq, dk_diag, dv_diag = block_attention_backward(qs, k[:, :, 4:], v[:, :, 4:], grad[:, :, 4:], lse, delta, scale, True)
    dq_early, dk_early, dv_early = block_attention_backward(qs, k[:, :, :4], v[:, :, :4], grad[:, :, 4:], lse, delta, scale, False)
    assert torch.allclose((dq + dq_early).double(), leaves[0].grad[:, :, 4:], atol=1e-6)
    assert torch.allclose(torch.cat([dk_early, dk_diag], 2).double(), leaves[1].grad, atol=1e-6)
    assert torch.allclose(torch.cat([dv_early, dv_diag], 2).double(), leaves[2].grad, atol=1e-6)


def test_model_rope_positions_select_the_shard_rows():
    torch.manual_seed(0)
    model = Transformer(get_model_args("llama3", "tiny"))
    tokens = torch.randint(0, 512, (2, 16))
    assert torch.equal(model(tokens), model(tokens, positions=torch.arange(16)))
    # one layer whose attention returns its rotated queries: a token's output depends only on the token and
    # its position, so a shuffled shard with its positions gives the shuffled rows
    model.layers = torch.nn.ModuleDict({"0": model.layers["0"]})
    model.layers["0"].attention.core = lambda q, k, v, document_ids=None: q
    order = torch.tensor([0, 1, 14, 15, 7, 3])
    assert torch.allclose(model(tokens[:, order], positions=order), model(tokens)[:, order], atol=1e-6)
    assert not torch.allclose(model(tokens[:, order]), model(tokens)[:, order], atol=1e-3)


def test_positions_hook_refuses_an_unsharded_batch():
    hook = context.positions_hook(SequenceLayout(2, True), rank=1, seq_len=16)
    args, kwargs = hook(None, (torch.zeros(2, 8, dtype=torch.long),), {})
    assert kwargs["positions"].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    with pytest.raises(ValueError, match="set up for sequences of 16 tokens \\(8 per rank\\), but this rank got 16"):
        hook(None, (torch.zeros(2, 16, dtype=torch.long),), {})


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--parallelism.cp", "4", "--training.seq_len", "36"],
         "training.seq_len=36 must be divisible by 2 x parallelism.cp = 8 (load-balanced split); use a multiple "
         "of 8 or set parallelism.cp_load_balance = false"),
        (["--parallelism.cp", "3", "--training.seq_len", "64", "--parallelism.cp_load_balance", "false"],
         "training.seq_len=64 must be divisible by parallelism.cp = 3 (contiguous split); use a multiple of 3"),
    ],
)
def test_sequence_length_must_split_into_the_layout_chunks(argv, message):
    with pytest.raises(ConfigError) as err:
        load_config(argv)
    assert message in str(err.value)
    load_config(["--parallelism.cp", "4", "--training.seq_len", "36", "--parallelism.cp_load_balance", "false"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--parallelism.cp_document_balance", "true", "--data.document_mask", "true", "--parallelism.cp_document_chunks", "3"],
         "training.seq_len=64 must be divisible by parallelism.cp x parallelism.cp_document_chunks = 6 (the "
         "document-aware split); use a multiple of 6 or fewer parallelism.cp_document_chunks"),
        (["--parallelism.cp_document_balance", "true", "--data.document_mask", "true", "--parallelism.cp_document_chunks", "0"],
         "parallelism.cp_document_chunks must be >= 1, got 0"),
    ],
)
def test_document_balancing_settings_are_checked(argv, message):
    with pytest.raises(ConfigError) as err:
        load_config(["--parallelism.cp", "2", "--training.seq_len", "64", *argv])
    assert message in str(err.value)
    load_config(["--parallelism.cp", "2", "--training.seq_len", "64", "--data.document_mask", "true"])


# ---------------------------------------------------------------------------
# Ring attention on 2 and 4 gloo ranks
# ---------------------------------------------------------------------------


def document_ids() -> torch.Tensor:
    return torch.stack([torch.repeat_interleave(torch.arange(len(d)), torch.tensor(d)) for d in DOCUMENT_LENGTHS])


def _ring_case(
    layout: SequenceLayout,
    ring: context.Ring,
    dtype: torch.dtype,
    autocast: bool,
    documents: torch.Tensor | None = None,
    v_dim: int = 16,
    kv_heads: int = 4,
) -> dict[str, float]:
    """Max |ring - full attention| on this rank's shard for the output and the q/k/v gradients."""
    generator = torch.Generator().manual_seed(0)  # the same full tensors on every rank
    heads = (4, kv_heads, kv_heads, 4)
    q, k, v, grad = (torch.randn(2, h, 64, d, generator=generator).to(dtype) for h, d in zip(heads, (16, 16, v_dim, v_dim)))
    full = [t.double().requires_grad_() for t in (q, k, v)]
    expanded = [full[0], *(t.repeat_interleave(4 // kv_heads, dim=1) for t in full[1:])]
    if documents is None:
        reference = F.scaled_dot_product_attention(*expanded, is_causal=True)
    else:
        mask = (documents[:, :, None] == documents[:, None, :]).tril()[:, None]
        reference = F.scaled_dot_product_attention(*expanded, attn_mask=mask)
    reference.backward(grad.double())

    shard = lambda t: layout.shard(t, ring.rank, dim=2)
    local = [shard(t).requires_grad_() for t in (q, k, v)]
    local_documents = None if documents is None else layout.shard(documents, ring.rank)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = context.ring_attention(*local, ring, layout, document_ids=local_documents)
        out.backward(shard(grad))
    errors = {"out": (out.double() - shard(reference.detach())).abs().max()}
    for name, mine, ref in zip("qkv", local, full):
        errors[f"d{name}"] = (mine.grad.double() - shard(ref.grad)).abs().max()
    return {name: float(err) for name, err in errors.items()}


def _record_forward_events(ring: context.Ring) -> list[str]:
    """The order of sends, waits and block computations in one forward pass of balanced ring attention."""
    events: list[str] = []
    pass_on, wait, attend = context.Ring.pass_on, context._InFlight.wait, context.block_attention
    context.Ring.pass_on = lambda self, tensor, tag: events.append("send") or pass_on(self, tensor, tag)
    context._InFlight.wait = lambda self: events.append("wait") or wait(self)
    context.block_attention = lambda *a: events.append("compute") or attend(*a)
    try:
        q = torch.randn(1, 2, 8, 4)
        context.ring_attention(q, q, q, ring, SequenceLayout(ring.size, True))
    finally:
        context.Ring.pass_on, context._InFlight.wait, context.block_attention = pass_on, wait, attend
    return events


def worker(out_file: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    ring = context.Ring(dist.group.WORLD)
    results = {}
    default_tile = context.SCORE_TILE_ELEMENTS
    for name, load_balance, dtype, tile, autocast in CASES:
        context.SCORE_TILE_ELEMENTS = tile
        errors = _ring_case(SequenceLayout(ring.size, load_balance), ring, dtype, autocast)
        context.SCORE_TILE_ELEMENTS = default_tile
        worst = torch.tensor(list(errors.values()), dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        results[name] = dict(zip(errors, worst.tolist()))
    ids = document_ids()
    for name, kind, v_dim, tile, kv_heads in DOCUMENT_CASES:
        context.SCORE_TILE_ELEMENTS = tile
        if kind == "document":
            layout = SequenceLayout(ring.size, assignment=assign_chunks(chunk_costs(ids, 64, 4 * ring.size), ring.size))
        else:
            layout = SequenceLayout(ring.size, kind == "balanced")
        errors = _ring_case(layout, ring, torch.float32, False, ids, v_dim, kv_heads)
        context.SCORE_TILE_ELEMENTS = default_tile
        worst = torch.tensor(list(errors.values()), dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        results[name] = dict(zip(errors, worst.tolist()))
    results["events"] = _record_forward_events(ring)
    if ring.rank == 0:
        out_file.write_text(json.dumps(results))
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo can abort in destructors at interpreter exit


@pytest.fixture(scope="module")
def ring_results(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("ring")
    results = {}
    for world_size in (2, 4):
        out = workdir / f"ring_{world_size}.json"
        run_ranks(worker, world_size, out)
        results[world_size] = json.loads(out.read_text())
    return results


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("case", [c[0] for c in CASES + DOCUMENT_CASES])
def test_ring_attention_matches_full_attention(ring_results, world_size, case):
    errors = ring_results[world_size][case]
    tolerance = BF16_TOLERANCE if "bf16" in case else TOLERANCE
    assert set(errors) == {"out", "dq", "dk", "dv"}
    assert max(errors.values()) <= tolerance, errors


@pytest.mark.parametrize("world_size", [2, 4])
def test_next_block_is_in_flight_while_the_current_one_is_computed(ring_results, world_size):
    events = ring_results[world_size]["events"]
    # every hop but the last: the next block is sent before this block's attention, and awaited after it
    steps = "".join({"send": "s", "wait": "w", "compute": "c"}[e] for e in events)
    hops = steps.split("w")
    assert len(hops) == world_size, steps
    assert all(hop.startswith("s") and "c" in hop for hop in hops[:-1]), steps
    assert "s" not in hops[-1] and "c" in hops[-1], steps
