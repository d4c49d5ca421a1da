"""Loss parity of context-parallel layouts against one process (fp32: 1e-5; bf16: testing/layout_parity.py's bound; 6 steps).

CP alone (balanced and contiguous, 2 and 4 ranks), with FSDP (parameters sharded over dp_shard x cp), with HSDP,
with TP, FSDP x TP x CP and PP x TP x CP on 8 ranks, and in bf16 alone and with PP x TP.
"""

import os

import pytest

from meshloom.testing.layout_parity import BF16_TOLERANCE, FP32_TOLERANCE, compare

PP_MICROBATCHES = ",pipeline.microbatches=2"
LAYOUTS = [
    "cp=2",
    "cp=2,cp_load_balance=false",
    "cp=4",
    "cp=4,cp_load_balance=false",
    "dp_shard=2,cp=2",
    "dp_replicate=2,cp=2",
    "tp=2,cp=2",
    "dp_shard=2,tp=2,cp=2",
    # A pipeline stage is parallelized by the same function as a whole model, which applies CP to it;
    # pp=2,tp=2,cp=2 also shards parameters over the cp ranks, so it runs PP x FSDP x TP x CP on 8 ranks. Two
    # microbatches of 4 sequences, not the default 8 of one: the schedules themselves are test_pipeline.py's, and
    # each microbatch costs these 8 ranks on 2 cores the same fixed dispatch overhead whatever its size.
    "pp=2,cp=2" + PP_MICROBATCHES,
    "pp=2,tp=2,cp=2" + PP_MICROBATCHES,
]
BF16_LAYOUTS = ["cp=2,mixed_precision=bf16", "pp=2,tp=2,cp=2,mixed_precision=bf16" + PP_MICROBATCHES]


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    os.environ.pop("WORLD_SIZE", None)
    reference, comparisons = compare(LAYOUTS + BF16_LAYOUTS, steps=6, workdir=tmp_path_factory.mktemp("cp-parity"))
    return reference, {c.layout.spec: c for c in comparisons}


@pytest.mark.parametrize("spec", LAYOUTS)
def test_context_parallel_layout_matches_one_process(parity, spec):
    reference, comparisons = parity
    c = comparisons[spec]
    assert len(c.curve.losses) == 6
    print(f"{spec}: max |dloss| {c.max_loss_diff:.2e}, |dgrad_norm| {c.grad_norm_diff:.2e}")
    assert c.max_loss_diff <= FP32_TOLERANCE, (spec, reference.losses, c.curve.losses)
    assert c.grad_norm_diff <= FP32_TOLERANCE


@pytest.mark.parametrize("spec", BF16_LAYOUTS)
def test_context_parallel_in_bf16_stays_within_the_bf16_bound(parity, spec):
    reference, comparisons = parity
    c = comparisons[spec]
    print(f"{spec}: max |dloss| {c.max_loss_diff:.2e}, |dgrad_norm| {c.grad_norm_diff:.2e}")
    assert 10 * FP32_TOLERANCE < c.max_loss_diff <= BF16_TOLERANCE, (spec, reference.losses, c.curve.losses)
    assert c.grad_norm_diff <= BF16_TOLERANCE
