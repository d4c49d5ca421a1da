"""Qwen3-Next under tensor and expert parallel: each equals one process within 1e-5 over 10 steps (fp32, gloo), with
Gated DeltaNet heads split over tp (projections, filters, decays and output norm) and the shared-gated experts
split over ep. FSDP, PP and CP parity across layouts is the matrix's."""

from __future__ import annotations

import os

from meshloom.testing.layout_parity import FP32_TOLERANCE, compare

# One launch of 2 ranks (TP 2 with document masks) and one of 4 (FSDP 2 x TP 2 x EP 2: the experts split over ep,
# every GDN and attention head over tp).
LAYOUTS = ["tp=2", "dp_shard=2,tp=2,ep=2"]
COMMON = "model.name=qwen3_next,model.flavor=tiny,data.document_mask=true,moe.z_loss_coef=1e-3"


def test_tensor_and_expert_parallel_equal_one_process(tmp_path):
    os.environ.pop("WORLD_SIZE", None)
    reference, comparisons = compare(LAYOUTS, steps=10, workdir=tmp_path, common=COMMON)
    for c in comparisons:
        print(f"parity qwen3_next {c.layout.spec}: max |dloss| {c.max_loss_diff:.2e}, |dgrad_norm| {c.grad_norm_diff:.2e}")
        assert c.max_loss_diff <= FP32_TOLERANCE and c.grad_norm_diff <= FP32_TOLERANCE, (c.layout.spec, reference.losses, c.curve.losses)
        assert c.max_aux_diff <= FP32_TOLERANCE, c.layout.spec
    assert reference.losses[-1] < reference.losses[0] - 0.3
