"""Every layout of the matrix with the chunked loss trains 10 steps at parity with one process that builds whole
logits: DeepSeek-V3 (experts and multi-token prediction, whose loss goes through the same chunked head), 4 layers,
32-token sequences, chunks of 100 tokens (no layout's microbatch is a multiple of 100), on gloo ranks forked in two
launches.

Layouts: FSDP, HSDP, TP (the vocabulary-sharded log-sum-exp), PP with 1F1B (the last stage) and with ZBVZeroBubble
(rank 0 holds the last stage), CP, EP and FSDP x TP. Bound: the parity harness's fp32 tolerance on every step's loss,
the prediction modules' loss, the last gradient norm and the held-out loss after the last step (which validation
takes in chunks too)."""

from __future__ import annotations

import os

import pytest

from meshloom.testing.layout_parity import FP32_TOLERANCE, ParityCase, launch, run_args, run_steps

STEPS = 10
COMMON = [
    "--model.name", "deepseek_v3", "--model.n_layers", "4", "--training.seq_len", "32",
    "--validation.enable", "true", "--validation.steps", "1", "--data.validation_fraction", "0.2",
]  # fmt: skip
CHUNKED = "loss.chunked=true,loss.chunk_tokens=100"
LAYOUTS = (
    "dp_shard=2",
    "tp=2",
    "pp=2,pipeline.microbatches=2",
    "pp=2,pipeline.microbatches=2,pipeline.schedule=ZBVZeroBubble",
    "cp=2",
    "dp_shard=2,ep=2",
    "dp_replicate=2,dp_shard=2",
    "dp_shard=2,tp=2",
)


@pytest.fixture(scope="module")
def curves(tmp_path_factory: pytest.TempPathFactory):
    os.environ.pop("WORLD_SIZE", None)
    workdir = tmp_path_factory.mktemp("chunked_layouts")
    reference = run_steps(run_args(STEPS, workdir, COMMON) + ["--job.dump_folder", str(workdir / "reference")])
    cases = [ParityCase.parse(f"{layout},{CHUNKED}") for layout in LAYOUTS]
    return reference, launch(cases, STEPS, workdir, COMMON)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_with_chunked_loss_matches_one_process_with_whole_logits(curves, layout: str) -> None:
    reference, by_spec = curves
    curve = by_spec[f"{layout},{CHUNKED}"]
    assert len(curve.losses) == STEPS
    loss_diff = max(abs(a - b) for a, b in zip(reference.losses, curve.losses, strict=True))
    assert loss_diff <= FP32_TOLERANCE, (layout, reference.losses, curve.losses)
    mtp = max(abs(a - b) for a, b in zip(reference.aux["mtp_loss"], curve.aux["mtp_loss"], strict=True))
    assert mtp <= FP32_TOLERANCE, (layout, reference.aux, curve.aux)
    assert abs(reference.grad_norms[-1] - curve.grad_norms[-1]) <= FP32_TOLERANCE
    assert reference.validation is not None and abs(reference.validation - curve.validation) <= FP32_TOLERANCE
