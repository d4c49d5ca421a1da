"""The planner against published runs (benchmarks/published_runs.py): every published layout that ran fits the
planner's own rule, the published memory figures within 10%, DeepSeek's and NeMo's 671B layouts within 25% of their
published throughput, and what the GPU adds beyond the estimated tensors. Rows the estimate does not yet meet are
strict expected failures naming why (benchmarks/RESULTS.md), so meeting one fails the test until it is promoted."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import sys
from pathlib import Path

import pytest

from meshloom.planning.gpu_memory import CUDA_CONTEXT_GIB, NCCL_ALL_TO_ALL_GIB, NCCL_COMMUNICATOR_GIB, gpu_added_bytes
from meshloom.planning.layout import Layout
from meshloom.planning.memory_estimate import GIB


def _published_runs():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "published_runs.py"
    spec = importlib.util.spec_from_file_location("published_runs_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


BENCH = _published_runs()
RUNS = {run.name: run for run in BENCH.RUNS}

# Rows the estimate does not fit or does not bring within 10%, and why (measured ratios in benchmarks/RESULTS.md).
# The memory figures compared are the estimate's reserved bytes (its tensor peak x the allocator's reserve measured on
# an H200, meshloom.planning.allocator) against torchtitan's logged max reserved.
# Every published layout that ran fits the planner's rule (rows that do not would be listed here with why).
NOT_FITTING: dict[str, str] = {}
# torchtitan's 8B rows move as published (eager -> compile -4.2 GiB against -5.4, compile -> Float8 -0.4 against -0.2)
# but all three lie about 12% below: no term of the estimate is missing that a CPU or H200 measurement shows, and
# torchtitan's launcher at that commit sets no expandable segments, so its reserve over the allocated peak
# (fragmentation) is not the H200's measured x1.05 and nothing published pins it down.
TITAN_8B = "the allocator's reserve without expandable segments is not measured (see TITAN_8B)"
MEMORY_OFF = {
    "Llama 3.1 8B, FSDP 8 (eager)": f"0.88: {TITAN_8B}",
    "Llama 3.1 8B, FSDP 8, compile (bf16)": f"0.89 (0.887): {TITAN_8B}",
    "Llama 3.1 8B, FSDP 8, compile + Float8": f"0.88: {TITAN_8B}",
    "Llama 3.1 70B, FSDP 32 x TP 8, Float8": "0.84: 11 GiB not named; under TP 8 the compiled block is the traced "
    "unsharded one in proportion to the shape model's TP share, not a trace of the sharded block",
    "Llama 3.1 405B, FSDP 8 x TP 8 x PP 8, 1F1B": "0.75: the published 1F1B peak is 9.8 GiB above Interleaved "
    "1F1B's with the same settings, while the estimate has them within 1.7 GiB",
    "Llama 3.1 405B, FSDP 8 x TP 8 x PP 8, Interleaved 1F1B": "0.87: 9 GiB not named, with the loss stage's logits "
    "held for the one microbatch torch's schedule keeps there at the rank's peak",
}


def _expected(name: str, failing: dict[str, str]):
    marks = [pytest.mark.xfail(strict=True, reason=failing[name])] if name in failing else []
    return pytest.param(name, marks=marks, id=name)


@pytest.mark.parametrize("name", [_expected(name, NOT_FITTING) for name in RUNS])
def test_every_published_layout_that_ran_fits_the_planners_rule(name):
    run = RUNS[name]
    prediction = BENCH.predict(run)
    assert prediction.fits, (prediction.device_gib, run.gpu_memory_gib)
    assert prediction.device_gib <= 0.9 * run.gpu_memory_gib


@pytest.mark.parametrize("name", [_expected(name, MEMORY_OFF) for name, run in RUNS.items() if run.memory_gib])
def test_published_memory_is_predicted_within_10_percent(name):
    run = RUNS[name]
    ratio = BENCH.predict(run).reserved_gib / run.memory_gib
    assert 0.9 <= ratio <= 1.1, ratio


@pytest.mark.parametrize("prefix", ["DeepSeek-V3 671B, PP 4", "DeepSeek-V3 671B, PP 16"])
def test_deepseek_and_nemo_671b_layouts_are_predicted_within_25_percent_of_their_throughput(prefix):
    """NeMo AutoModel's (PP 4 x EP 64 on 256 H100, at its logged MFU, DeepEP's overlap) and DeepSeek's own (PP 16 x EP
    64 on 2,048 H800, DualPipe hiding the all-to-all behind the paired chunk, H800 links), each with full AC (NeMo's
    config states it; for DeepSeek's own recomputation it is the lightest meshloom mode the estimate fits), both fitting
    candidates: under the planner's rule on their 80 GiB GPUs."""
    (run,) = [r for n, r in RUNS.items() if n.startswith(prefix)]
    prediction = BENCH.predict(run)
    assert prediction.fits and prediction.device_gib <= 0.9 * run.gpu_memory_gib
    ratio = prediction.time.tokens_per_s_per_gpu / run.tokens_per_s_per_gpu
    assert 0.75 <= ratio <= 1.25, ratio
    assert prediction.layout.ac == "full"


def test_torchtitans_op_policy_recomputes_every_second_matmul():
    """Llama 3 8B, one block, tp 1, bf16: torchtitan's selective op policy drops wk, wo and w3's outputs (kv, dim and
    FFN hidden per token, 2 bytes each) from what meshloom's selective_op keeps; other modes are untouched."""
    shape = BENCH.shape_of(RUNS["Llama 3.1 8B, FSDP 8 (eager)"])
    plain = BENCH.get_model_spec("llama3").shape_model(BENCH.get_model_args("llama3", "8B"))
    def kept(model, mode):
        return model.block_activation_bytes_per_token(0, mode, 1, 2)

    assert kept(plain, "selective_op") - kept(shape, "selective_op") == 2 * (1024 + 4096 + 14336)
    for mode in ("none", "full"):
        assert kept(shape, mode) == kept(plain, mode)


def test_a_gpu_adds_the_cuda_context_and_a_nccl_communicator_per_parallel_dimension():
    assert gpu_added_bytes(Layout()) == CUDA_CONTEXT_GIB * GIB
    fsdp_tp_pp = Layout(dp_shard=8, tp=8, pp=8)
    assert gpu_added_bytes(fsdp_tp_pp) == pytest.approx((CUDA_CONTEXT_GIB + 3 * NCCL_COMMUNICATOR_GIB) * GIB)
    # Expert parallel borrows the FSDP ranks but runs its all-to-all on a communicator of its own.
    moe = Layout(dp_shard=8, ep=8)
    expected = CUDA_CONTEXT_GIB + 2 * NCCL_COMMUNICATOR_GIB + NCCL_ALL_TO_ALL_GIB
    assert gpu_added_bytes(moe) == pytest.approx(expected * GIB)


def test_a_bf16_model_and_loss_halve_the_state_and_the_losss_vocabulary_wide_tensors():
    """AutoModel's rows: parameters, reduced gradients and Adam's moments in bf16 (its model dtype), the loss's logits
    and their gradients in bf16 (no fp32 upcast); FSDP's fp32 reduce dtype and the activations are unchanged."""
    run = RUNS["Qwen3-30B-A3B, FSDP 8 x EP 8 (NeMo AutoModel)"]
    shape = BENCH.shape_of(run)
    layout = Layout(dp_shard=8, ep=8, ac="full")  # one microbatch: reduced gradients, not accumulated ones
    fp32 = BENCH.estimate_memory(shape, layout, run.seq_len, BENCH.Precision("bf16"))
    bf16 = BENCH.estimate_memory(shape, layout, run.seq_len, run.precision)
    assert (bf16.params, bf16.grads, bf16.optimizer) == (fp32.params // 2, fp32.grads // 2, fp32.optimizer // 2)
    assert bf16.transient == fp32.transient // 2 == 2 * 2 * layout.microbatch_size * run.seq_len * shape.vocab_size


def test_automodel_leaves_experts_that_fsdp_would_not_shard_out_of_it():
    """AutoModel's MoE parallelizer FSDP-shards experts only over an ep_shard mesh larger than 1 and otherwise passes
    them to the block as ignored parameters: with dp_shard = ep they are never gathered and their gradients stay
    autograd's bf16 ones while the dense gradients accumulate unsharded in fp32. Where FSDP does shard them (ep_shard
    2), AutoModel wraps them like meshloom does."""
    run = RUNS["Qwen3-30B-A3B, FSDP 8 x EP 8 (NeMo AutoModel)"]
    shape = BENCH.shape_of(run)
    wrapped = dataclasses.replace(run.precision, fsdp_wraps_whole_experts=True)
    whole = [p for layer in range(shape.n_layers) for p in shape.block_params(layer)]
    experts = sum(math.prod(p.shape) for p in whole if p.expert) // 8  # this rank's 16 of 128 experts per block
    out = BENCH.estimate_memory(shape, run.layout, run.seq_len, run.precision)
    inside = BENCH.estimate_memory(shape, run.layout, run.seq_len, wrapped)
    assert inside.grads - out.grads == (4 - 2) * experts  # fp32 accumulated unsharded, against bf16 in place
    assert inside.gathered - out.gathered == 2 * experts  # every block's experts kept gathered (no resharding)
    sharded = dataclasses.replace(run.layout, dp_shard=16)  # ep_shard 2: experts are FSDP units again
    assert BENCH.estimate_memory(shape, sharded, run.seq_len, run.precision) == BENCH.estimate_memory(
        shape, sharded, run.seq_len, wrapped
    )
