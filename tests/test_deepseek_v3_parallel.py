"""DeepSeek-V3 under parallel layouts: the dry runs (tiny, and 671B on 1,024 ranks with EP 8) against the estimator,
the tensor and expert parallel plans of the MoE blocks, the estimator against the memory tracker on `debug`, and loss
parity against one process (fp32, 10 steps, 1e-5) with multi-token prediction, MoE blocks and bias balancing on, for
FSDP, EP, TP (with full activation checkpointing), CP and PP (1F1B and ZBVZeroBubble), all in one launch of
2 ranks. FSDP 2 x EP 2 x TP 2 (4 ranks) rides on tests/test_expert_parallel.py's 4-rank launch."""

from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from meshloom.config.loader import load_config
from meshloom.models.deepseek_v3.parallelize import moe_layers
from meshloom.models.registry import get_model_spec
from meshloom.parallel.apply import carve_stage, parallelize
from meshloom.planning.dry_run import dry_run
from meshloom.planning.layout import layout_of, precision_from_config
from meshloom.planning.memory_estimate import estimate_memory
from meshloom.planning.run_plan import RunPlan
from meshloom.testing.layout_parity import FP32_TOLERANCE, compare

SPEC = get_model_spec("deepseek_v3")
# Measured against the estimator (tests/test_plan.py measures llama3 the same way).
MEASURED_LAYOUTS = ["tp=2"]


# --------------------------------------------------------------------------- plans on meta


def test_expert_parallel_splits_every_moe_block_under_tensor_parallel():
    """FSDP 2 x EP 2 x TP 2 (rank 0 of 4, fake process group, meta model): the routed experts of the main MoE block
    and of both prediction modules' blocks are split by expert over ep (4 of 8 on this rank, not replicated over tp);
    the router stays replicated over tp, the shared experts split; the estimator counts the same local shards."""
    settings = ["--model.name", "deepseek_v3", "--model.flavor", "tiny", "--parallelism.tp", "2", "--parallelism.ep", "2"]
    plan = RunPlan.build(load_config(settings), 4)
    assert (plan.dims.dp_shard, plan.dims.ep, plan.dims.efsdp) == (2, 2, 1)
    dist.init_process_group(backend="fake", store=FakeStore(), rank=0, world_size=4)
    try:
        plan.dims.build_mesh("cpu")
        with torch.device("meta"):
            model = parallelize(SPEC.model_cls(plan.model_args), plan)
    finally:
        dist.destroy_process_group()
    layers = moe_layers(model)
    assert sorted(layers) == ["1", "2", "3"]
    for moe in layers.values():
        for param in (moe.experts.w1, moe.experts.w2, moe.experts.w3):
            assert param.device_mesh.mesh_dim_names == ("efsdp", "ep") and param.shape[0] == 8
            assert param.to_local().shape[0] == 4
        assert moe.router.weight.placements[-1] == Replicate() and moe.router.weight.device_mesh.mesh_dim_names[-1] == "tp"
        assert moe.shared_experts.w1.weight.device_mesh.mesh_dim_names[-1] == "tp"
        assert moe.shared_experts.w1.weight.placements[-1] == Shard(0)
    report = dry_run(load_config(settings), 4)
    assert report.built_param_bytes == report.rank_params and report.comm_bytes["ep"] > 0


def test_tensor_parallel_plan_of_the_moe_blocks():
    """Router and routed experts replicated over tp (whole copies), shared experts split like a dense MLP, in the main
    blocks and the prediction modules' (meta model, rank 0 of 2 in torch's fake process group)."""
    plan = RunPlan.build(load_config(["--model.name", "deepseek_v3", "--model.flavor", "tiny", "--parallelism.tp", "2"]), 2)
    dist.init_process_group(backend="fake", store=FakeStore(), rank=0, world_size=2)
    try:
        plan.dims.build_mesh("cpu")
        with torch.device("meta"):
            model = parallelize(SPEC.model_cls(plan.model_args), plan)
    finally:
        dist.destroy_process_group()
    layers = moe_layers(model)
    assert sorted(layers) == ["1", "2", "3"]  # block 1, and the two prediction modules' blocks (2 and 3)
    for moe in layers.values():
        for param in (moe.router.weight, moe.experts.w1, moe.experts.w2, moe.experts.w3):
            assert isinstance(param, DTensor) and param.placements == (Replicate(),) and param.to_local().shape == param.shape
        assert moe.shared_experts.w1.weight.placements == (Shard(0),) and moe.shared_experts.w1.weight.to_local().shape == (16, 64)
        assert moe.shared_experts.w2.weight.placements == (Shard(1),)
        assert not isinstance(moe.expert_bias, DTensor)


@pytest.mark.parametrize(
    "overrides",
    [
        ["--parallelism.tp", "2"],  # FSDP 4 x TP 2: rank 0 holds the whole model, prediction modules included
        ["--parallelism.tp", "2", "--parallelism.pp", "2"],  # PP 2 x FSDP 2 x TP 2: rank 0 holds the first stage
    ],
)
def test_dry_run_of_tiny_matches_its_estimate(overrides):
    config = load_config([
        "--model.name", "deepseek_v3", "--model.flavor", "tiny", "--model.n_layers", "4", "--training.seq_len", "64",
        "--training.local_batch_size", "4", "--training.mixed_precision", "bf16", *overrides,
    ])  # fmt: skip
    report = dry_run(config, 8)
    assert report.built_param_bytes == report.rank_params
    assert report.memory.peak > report.memory.params > 0 and report.comm_bytes["tp"] > 0


def test_dry_run_of_671b_on_1024_ranks():
    """The recipe's PP 16 x EP 8 x FSDP 64 in one CPU process. Rank 0's stage holds the 3 dense blocks only, so the
    last stage (MoE blocks, the prediction module's MoE block, the embedding copy and the output) is built too, as
    rank 1023: every routed expert stack split over ep 8 (32 of 256) and FSDP-sharded over the 8 ranks left (4), and
    its bytes exactly the estimator's for that stage."""
    config = load_config(["--config", "configs/deepseek_v3_671b.toml"])
    assert (config.parallelism.pp, config.parallelism.ep) == (16, 8)
    report = dry_run(config, 1024)
    print(report.format())
    assert report.seconds < 120
    assert "pp=16" in report.layout and "ep=8" in report.layout
    assert report.built_param_bytes == report.rank_params

    plan = RunPlan.build(config, 1024)
    last = plan.pipeline.num_stages - 1
    dist.init_process_group(backend="fake", store=FakeStore(), rank=1023, world_size=1024)
    try:
        plan.dims.build_mesh("cpu")
        assert plan.pipeline.stages_of(plan.dims.mesh("pp").get_local_rank()) == [last]
        with torch.device("meta"):
            stage = carve_stage(SPEC.model_cls(plan.model_args), SPEC.parallel, plan.pipeline.stage_layers[last], False, True)
            stage = parallelize(stage, plan)
    finally:
        dist.destroy_process_group()
    layers = moe_layers(stage)
    assert "61" in layers and len(layers) == len(plan.pipeline.stage_layers[last]) + 1
    for moe in layers.values():
        assert moe.experts.w1.shape[0] == 256 and moe.experts.w1.to_local().shape[0] == 4
    built = sum(4 * (p.to_local() if isinstance(p, DTensor) else p).numel() for p in stage.parameters())
    layout, precision = layout_of(plan), precision_from_config(config)
    estimate = estimate_memory(plan.shape(), layout, config.training.seq_len, precision, stage_index=last)
    assert built == estimate.params
    print(f"last stage: {len(layers)} MoE layers, {built / 2**30:.2f} GiB of parameters, peak {estimate.peak / 2**30:.2f} GiB")


def _memory_benchmark():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "memory_estimate.py"
    module_spec = importlib.util.spec_from_file_location("memory_estimate_benchmark", path)
    bench = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(bench)
    return bench


@pytest.mark.parametrize("layout", MEASURED_LAYOUTS)
def test_estimate_matches_tracked_memory_of_debug(tmp_path, layout):
    """`debug` cut to 2 blocks (one dense, one MoE) with its MoE prediction module, trained on gloo ranks: local
    shards exactly and the memory tracker's activation peak (MLA, routed and shared experts, the prediction module;
    recomputation included) within the llama3 bound of 20% of the estimate."""
    bench = _memory_benchmark()
    args = argparse.Namespace(flavor="debug", seq_len=64, batch=2)
    ranks = bench.measure(f"model.name=deepseek_v3,model.n_layers=2,{layout}", args, tmp_path, 0)
    assert not isinstance(ranks, str), f"{layout}: {ranks}"
    for result in ranks:
        for kind, tolerance in bench.TARGETS.items():
            measured, estimated = result["measured"][kind], result["estimated"][kind]
            assert abs(measured / estimated - 1) <= tolerance, (layout, kind, measured, estimated)


# --------------------------------------------------------------------------- parity

# MTP (2 depths, tiny's), 1 dense + 3 MoE blocks (and the 2 prediction modules' MoE blocks), aux-loss-free balancing
# at 10x DeepSeek's rate so the bias steers routing within 10 steps (against no bias it moves the reference's losses
# by up to 4e-3, 400x the bound), and the router z-loss; 32-token sequences. The sequence-wise balance
# loss stays off: context parallel refuses it (it needs whole sequences), and one reference serves every layout.
COMMON = "model.name=deepseek_v3,model.n_layers=4,training.seq_len=32,moe.bias_update_rate=0.01,moe.z_loss_coef=1e-3"
LAYOUTS = [
    "dp_shard=2",
    "dp_shard=2,ep=2",  # 4 routed experts per rank, no FSDP of them (efsdp 1); FSDP 2 x EP 2 x TP 2 runs on 4 ranks
    "tp=2,activation_checkpoint.mode=full",
    "cp=2",
    "pp=2,pipeline.schedule=1F1B",
    "pp=2,pipeline.schedule=ZBVZeroBubble",
]


def test_multi_rank_parity_with_mtp_and_moe(tmp_path, data_cache):
    """Every layout in one launch of 2 ranks, each compared with one 1-process reference: per-step losses,
    per-step multi-token-prediction losses and the last gradient norm."""
    os.environ.pop("WORLD_SIZE", None)
    (tmp_path / "cache").symlink_to(data_cache)
    reference, comparisons = compare(LAYOUTS, steps=10, workdir=tmp_path, common=COMMON)
    assert len(reference.aux["mtp_loss"]) == 10
    for c in comparisons:
        print(f"parity {c.layout.spec}: max |dloss| {c.max_loss_diff:.2e}, |dmtp| {c.max_aux_diff:.2e}, |dgrad_norm| {c.grad_norm_diff:.2e}")
    failures = [(c.layout.spec, reference.losses, c.curve.losses) for c in comparisons if not c.ok]
    assert not failures, failures
    assert all(c.layout.tolerance == FP32_TOLERANCE for c in comparisons)
    assert reference.losses[-1] < reference.losses[0] - 0.3
