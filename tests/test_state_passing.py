"""State-passing context parallel for Gated DeltaNet against one process: outputs and gradients of the rule and the
causal convolution, on real gloo ranks.

One launch of 4 ranks runs every case: cp 4 on all of them, cp 2 on the pairs (0, 1) and (2, 3) at once.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from meshloom.models.common.gated_delta import LOCAL_CORE
from meshloom.parallel.document_balance import DocumentBalancedLayout, chunk_costs
from meshloom.parallel.sequence_layout import SequenceLayout
from meshloom.parallel.state_passing import StatePassingCore, sequence_slots
from meshloom.testing.ranks import run_ranks

TOLERANCE = 1e-5
SEQ, BATCH, HEADS, DK, DV, CHANNELS, WIDTH = 48, 2, 2, 8, 6, 5, 4
# Row 0: documents start at 5, 12 (a chunk edge for chunks of 6 and 12 tokens), 13, 24 (a chunk edge for every
# layout here) and 40, so 13..23 and 24..39 span several ranks' chunks; row 1 is one document over every rank.
DOCUMENT_LENGTHS = [[5, 7, 1, 11, 16, 8], [48]]
# (name, cp, layout, documents, sequence length): layouts "contiguous" (1 chunk per rank), "balanced" (head-tail, 2),
# "document" (the per-batch document-aware assignment, 3 chunks per rank). 16 tokens over cp 4 balanced makes
# chunks of 2 tokens, shorter than the convolution's history of 3.
CASES = [
    (f"cp{cp}_{layout}{'_documents' if documents else ''}", cp, layout, documents, SEQ)
    for cp in (2, 4)
    for layout in ("contiguous", "balanced", "document")
    for documents in (False, True)
    if not (layout == "document" and not documents)
] + [("cp4_balanced_short_chunks_documents", 4, "balanced", True, 16)]
QUANTITIES = ["rule", "conv", "dq", "dk", "dv", "dg", "dbeta", "dx", "dweight"]


def document_ids(seq: int) -> torch.Tensor:
    rows = [torch.repeat_interleave(torch.arange(len(d)), torch.tensor(d)) for d in DOCUMENT_LENGTHS]
    return torch.stack(rows)[:, :seq]


def _layout(kind: str, cp: int, ids: torch.Tensor | None, seq: int):
    if kind == "document":
        layout = DocumentBalancedLayout(cp, 3)
        layout.plan(chunk_costs(ids, seq, layout.num_chunks))
        return layout
    return SequenceLayout(cp, load_balance=kind == "balanced")


def _inputs(seq: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)  # the same full tensors on every rank

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    q = F.normalize(rand(BATCH, seq, HEADS, DK), dim=-1)
    k = F.normalize(rand(BATCH, seq, HEADS, DK), dim=-1)
    v = rand(BATCH, seq, HEADS, DV)
    g = F.logsigmoid(rand(BATCH, seq, HEADS) + 2.0)
    beta = torch.sigmoid(rand(BATCH, seq, HEADS))
    x, weight = rand(BATCH, seq, CHANNELS), rand(CHANNELS, WIDTH)
    rule_grad, conv_grad = rand(BATCH, seq, HEADS, DV), rand(BATCH, seq, CHANNELS)
    return [q, k, v, g, beta, x, weight, rule_grad, conv_grad]


def _run(core, leaves, ids, rule_grad, conv_grad):
    q, k, v, g, beta, x, weight = leaves
    rule = core.rule(q, k, v, g, beta, 0.5, document_ids=ids)
    conv = core.conv(x, weight, document_ids=ids)
    ((rule * rule_grad).sum() + (conv * conv_grad).sum()).backward()
    return rule.detach(), conv.detach()


def _case(group, cp: int, kind: str, documents: bool, seq: int) -> tuple[dict[str, float], dict[str, int]]:
    """Max |cp - one process| per quantity on this rank's shard, and the bytes this rank sent."""
    import torch.distributed as dist

    ids = document_ids(seq) if documents else None
    layout = _layout(kind, cp, ids, seq)
    *tensors, rule_grad, conv_grad = _inputs(seq)
    reference = [t.clone().requires_grad_() for t in tensors]
    expected = _run(LOCAL_CORE, reference, ids, rule_grad, conv_grad)

    rank = dist.get_rank(group)
    shard = lambda t: layout.shard(t, rank)  # noqa: E731
    local = [shard(t).requires_grad_() for t in tensors[:-1]] + [tensors[-1].clone().requires_grad_()]
    # Rule chunks of 5 tokens: several per context-parallel chunk, padded, and a document edge inside one.
    core = StatePassingCore(group, layout, chunk_size=5)
    got = _run(core, local, None if ids is None else shard(ids), shard(rule_grad), shard(conv_grad))
    # The convolution weight is replicated: its gradient is the sum of the ranks' (as data parallel reduces it).
    dist.all_reduce(local[-1].grad, group=group)
    errors = {"rule": got[0] - shard(expected[0]), "conv": got[1] - shard(expected[1])}
    for name, mine, ref in zip(QUANTITIES[2:-1], local, reference):
        errors[name] = mine.grad - shard(ref.grad)
    errors["dweight"] = local[-1].grad - reference[-1].grad
    sent = {"forward": core.bytes_sent.forward, "backward": core.bytes_sent.backward}
    return {name: float(err.abs().max()) for name, err in errors.items()}, sent


def worker(out_file: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    results: dict = {}
    for name, cp, kind, documents, seq in CASES:
        group = dist.group.WORLD if cp == 4 else pairs[rank // 2]
        errors, sent = _case(group, cp, kind, documents, seq)
        worst = torch.tensor(list(errors.values()), dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        results[name] = {"errors": dict(zip(errors, worst.tolist())), "sent": sent}
    if rank == 0:
        out_file.write_text(json.dumps(results))
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo can abort in destructors at interpreter exit


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("state_passing") / "results.json"
    run_ranks(worker, 4, out)
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_state_passing_matches_one_process(results, case):
    errors = results[case]["errors"]
    assert set(errors) == set(QUANTITIES)
    assert max(errors.values()) <= TOLERANCE, errors


@pytest.mark.parametrize("cp", [2, 4])
def test_bytes_sent_are_the_pairs_and_tails_not_the_sequence(results, cp):
    """Without documents a rank sends (cp - 1) x its chunks' (B, T) pairs and convolution tails, forward, and as much
    again backward (their gradients): nothing that grows with the sequence."""
    per_rank = 2  # balanced
    pairs = BATCH * HEADS * DK * (DV + DK) * 4
    tails = BATCH * (WIDTH - 1) * CHANNELS * 4
    expected = (cp - 1) * per_rank * (pairs + tails)
    assert results[f"cp{cp}_balanced"]["sent"] == {"forward": expected, "backward": expected}


def test_sequence_slots_follow_the_layout():
    assert sequence_slots(SequenceLayout(2, load_balance=True)) == [0, 2, 3, 1]
    assert sequence_slots(SequenceLayout(3, load_balance=False)) == [0, 1, 2]
    assert sequence_slots(SequenceLayout(2, assignment=((1, 2), (0, 3)))) == [2, 0, 1, 3]
