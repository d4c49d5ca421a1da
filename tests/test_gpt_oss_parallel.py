"""gpt-oss under every layout it supports: each equals one process within 1e-5 over 10 steps (fp32, gloo), with
windows and sinks in every layer and the biased experts in every block; the refused combinations say why."""

from __future__ import annotations

import os

import pytest

from meshloom.config.loader import load_config
from meshloom.planning.run_plan import RunPlan
from meshloom.testing.layout_parity import FP32_TOLERANCE, compare

# One launch of 2 ranks for FSDP 2, TP 2, PP 2 (2 microbatches), CP 2 (meshloom's ring, cut by the windows, with
# the sinks through its log-sum-exp), EP 2, and activation checkpointing under FSDP and TP; one of 4 for FSDP 2 x EP 2
# (4 experts per rank, each stack FSDP-sharded over 2), FSDP 2 x TP 2 (the sinks sharded on both meshes), HSDP 2 x 2
# and CP 2 x TP 2. Bias balancing is on (the default rate) and the router z-loss; the sequence-wise balance loss is
# refused under CP.
CAUSAL = [
    "dp_shard=2", "tp=2", "pp=2,pipeline.microbatches=2", "cp=2", "dp_shard=2,ep=2",
    "dp_shard=2,activation_checkpoint.mode=full", "tp=2,activation_checkpoint.mode=selective_op",
    "dp_shard=4,ep=2", "dp_shard=2,tp=2", "dp_replicate=2,dp_shard=2", "cp=2,tp=2",
]  # fmt: skip
# Document masks on top of the windows: TP, the ring on head-tail chunks, and on the document-aware layout.
DOCUMENTS = ["tp=2", "cp=2", "cp=2,parallelism.cp_document_balance=true"]
# Muon (the expert biases, sinks and router on AdamW) under FSDP and TP.
MUON = ["dp_shard=2", "tp=2"]
COMMON = "model.name=gpt_oss,moe.z_loss_coef=1e-3"
RUNS = {"causal": (CAUSAL, ""), "documents": (DOCUMENTS, ",data.document_mask=true"), "muon": (MUON, ",optimizer.name=Muon")}


@pytest.mark.parametrize("run", list(RUNS))
def test_every_layout_equals_one_process(tmp_path, run):
    os.environ.pop("WORLD_SIZE", None)
    layouts, settings = RUNS[run]
    reference, comparisons = compare(layouts, steps=10, workdir=tmp_path, common=COMMON + settings)
    for c in comparisons:
        print(f"parity gpt_oss {run} {c.layout.spec}: max |dloss| {c.max_loss_diff:.2e}, |dgrad_norm| {c.grad_norm_diff:.2e}")
        assert c.max_loss_diff <= FP32_TOLERANCE and c.grad_norm_diff <= FP32_TOLERANCE, (c.layout.spec, reference.losses, c.curve.losses)
        assert c.max_aux_diff <= FP32_TOLERANCE, c.layout.spec
    assert reference.losses[-1] < reference.losses[0] - 0.3


@pytest.mark.parametrize(
    ("settings", "world", "message"),
    [
        (["--compile.enable", "true", "--training.device", "cpu"], 1, "compiles FlexAttention on CPU for inference only"),
        (["--parallelism.tp", "8"], 8, "parallelism.tp=8 does not divide the model's n_kv_heads=4"),
        (["--optimizer.qk_clip_threshold", "1.0"], 1, "q and k projections carry biases"),
    ],
)
def test_refused_settings_say_why(settings, world, message):
    config = load_config(["--model.name", "gpt_oss", "--model.flavor", "tiny", "--training.seq_len", "64", *settings])
    with pytest.raises(ValueError, match=message):
        RunPlan.build(config, world)
