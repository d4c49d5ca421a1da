"""DeepSeek-V3 under parallel layouts: the dry runs (tiny, and 671B on 1,024 ranks) against the estimator, the tensor
parallel plan of the MoE blocks, and loss parity against one process (fp32, 10 steps, 1e-5) with multi-token
prediction, MoE blocks and bias balancing on, for FSDP, TP, CP, PP (1F1B and ZBVZeroBubble), AC and compile, all
in one torchrun launch."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from meshloom.config.loader import load_config
from meshloom.models.deepseek_v3.parallelize import moe_layers
from meshloom.models.registry import get_model_spec
from meshloom.planning.dry_run import dry_run
from meshloom.planning.run_plan import RunPlan
from meshloom.tools.parity import FP32_TOLERANCE, Layout, base_overrides, launch, run_steps

SPEC = get_model_spec("deepseek_v3")


# --------------------------------------------------------------------------- plans on meta


def test_tensor_parallel_plan_of_the_moe_blocks():
    """Router and routed experts replicated over tp (whole copies), shared experts split like a dense MLP, in the main
    blocks and the prediction modules' (meta model, rank 0 of 2 in torch's fake process group)."""
    plan = RunPlan.build(load_config(["--model.name", "deepseek_v3", "--model.flavor", "tiny", "--parallelism.tp", "2"]), 2)
    dist.init_process_group(backend="fake", store=FakeStore(), rank=0, world_size=2)
    try:
        plan.dims.build_mesh("cpu")
        with torch.device("meta"):
            model = SPEC.parallelize(SPEC.model_cls(plan.model_args), plan.dims, plan.config)
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
    config = load_config(["--config", "configs/deepseek_v3_671b.toml"])
    report = dry_run(config, 1024)
    print(report.format())
    assert report.seconds < 120
    assert report.built_param_bytes == report.rank_params


# --------------------------------------------------------------------------- parity

DS = "model.name=deepseek_v3,model.n_layers=4"
# MTP (2 depths, tiny's), 1 dense + 3 MoE blocks, bias balancing at the default rate; the balance losses too, except
# under context parallel, which refuses the sequence-wise loss (it needs whole sequences).
REFERENCES = {"moe": DS + ",moe.aux_loss_coef=1e-2,moe.z_loss_coef=1e-3", "moe_cp": DS + ",moe.z_loss_coef=1e-3"}
CASES_BY_REFERENCE = {
    "moe": [
        "dp_shard=2",
        "tp=2",
        "pp=2,pipeline.schedule=1F1B",
        "pp=2,pipeline.schedule=ZBVZeroBubble",
        "dp_shard=2,activation_checkpoint.mode=selective_op,compile.enable=true",
        "tp=2,activation_checkpoint.mode=full",
    ],
    "moe_cp": ["cp=2"],
}


def test_multi_rank_parity_with_mtp_and_moe(tmp_path, data_cache):
    """Every layout in one torchrun launch of 2 ranks; each compared with its 1-process reference: losses, the
    multi-token-prediction loss and the last gradient norm."""
    os.environ.pop("WORLD_SIZE", None)
    (tmp_path / "cache").symlink_to(data_cache)
    references = {
        name: run_steps(base_overrides(10, tmp_path) + Layout.parse(settings).setting_args() + ["--job.dump_folder", str(tmp_path / name)])
        for name, settings in REFERENCES.items()
    }
    specs = {f"{layout},{REFERENCES[name]}": name for name, layouts in CASES_BY_REFERENCE.items() for layout in layouts}
    curves = launch([Layout.parse(spec) for spec in specs], 10, tmp_path)
    failures = []
    for spec, name in specs.items():
        reference, curve = references[name], curves[spec]
        loss_diff = max(abs(a - b) for a, b in zip(reference.losses, curve.losses, strict=True))
        mtp_diff = max(abs(a - b) for a, b in zip(reference.aux["mtp_loss"], curve.aux["mtp_loss"], strict=True))
        norm_diff = abs(reference.grad_norms[-1] - curve.grad_norms[-1])
        print(f"parity {spec}: max |dloss| {loss_diff:.2e}, |dmtp| {mtp_diff:.2e}, |dgrad_norm| {norm_diff:.2e}")
        if max(loss_diff, mtp_diff, norm_diff) > FP32_TOLERANCE:
            failures.append((spec, reference.losses, curve.losses))
    assert not failures, failures
    assert references["moe"].losses[-1] < references["moe"].losses[0] - 0.3
