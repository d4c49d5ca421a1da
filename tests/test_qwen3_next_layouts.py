"""Qwen3-Next under every layout: each equals one process within 1e-5 over 10 steps (fp32, gloo).

Three of every four blocks are Gated DeltaNet. Under context parallel they pass their state between sequence shards
(meshloom/parallel/state_passing.py) while the attention blocks run the ring, on the one token layout. Without document
masks the run reads the built-in corpus; with them, short packed documents, so most sequences hold several documents
and the state and the convolution history reset inside shards and at shard edges. Each document layout covers a
different token layout: head-tail chunks (the state scan runs over 2 x cp chunks in sequence order), contiguous chunks,
and the per-batch document-aware split. Each run is one launch of 2 ranks and one of 4.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from shard_fixtures import document, load_tokenizer, prepared, tokenizer_json

from meshloom.testing.layout_parity import FP32_TOLERANCE, compare

COMMON = "model.name=qwen3_next,moe.z_loss_coef=1e-3"
CAUSAL = [
    "dp_shard=2", "tp=2", "pp=2,pipeline.microbatches=2", "dp_shard=2,ep=2", "cp=2",
    "cp=4", "cp=2,tp=2", "dp_shard=2,tp=2,ep=2",
]  # fmt: skip
DOCUMENTS = [
    "cp=2", "cp=2,cp_load_balance=false", "cp=2,cp_document_balance=true",
    "cp=4", "cp=2,tp=2",
]  # fmt: skip


def _short_documents(workdir: Path) -> str:
    tokenizer = tokenizer_json(workdir / "tok")
    texts = [document(i, 3 + (i * 13) % 38) for i in range(240)]
    folder = prepared(workdir / "shards", load_tokenizer(tokenizer), texts, shard_tokens=4000)
    return f",data.dataset=shards,data.shards={folder},data.tokenizer={tokenizer},data.document_mask=true"


@pytest.mark.parametrize("run", ["causal", "documents"])
def test_every_layout_equals_one_process(tmp_path: Path, run: str) -> None:
    os.environ.pop("WORLD_SIZE", None)
    layouts, common = (CAUSAL, COMMON) if run == "causal" else (DOCUMENTS, COMMON + _short_documents(tmp_path))
    reference, comparisons = compare(layouts, steps=10, workdir=tmp_path, common=common)
    for c in comparisons:
        print(f"parity qwen3_next {run} {c.layout.spec}: max |dloss| {c.max_loss_diff:.2e}, |dgrad_norm| {c.grad_norm_diff:.2e}")
        assert c.max_loss_diff <= FP32_TOLERANCE and c.grad_norm_diff <= FP32_TOLERANCE, (c.layout.spec, reference.losses, c.curve.losses)
        assert c.max_aux_diff <= FP32_TOLERANCE, c.layout.spec
    assert reference.losses[-1] < reference.losses[0] - 0.3
