"""Expert parallel: every layout equals one process, checkpoints resume and reshard, the mesh and errors are right.

All multi-rank training runs are fp32 Qwen3 `tiny_moe` (8 experts, top 2, 2 blocks) with bias balancing on (the
default rate), batched into one launch per world size (testing/resume_parity.py, built on the parity harness's
settings). Each layout is compared with a 1-process reference of as many steps to 1e-5. Every layout runs with
compile and selective activation checkpointing together, for 6 steps (a layout's first step, where DTensor plans
every operator and the blocks compile, costs its ranks more than the others together); EP 2 on 2 ranks and CP 2 x EP 2
(with 2 accumulation steps) also run eager without checkpointing for 10 steps, as do the resume cases.

DeepSeek-V3's FSDP 2 x EP 2 x TP 2 parity (MLA, multi-token prediction, shared experts, bias balancing) rides on
the 4-rank launch too, against its own 1-process reference (its 2-rank EP case is in test_deepseek_v3_parallel.py).
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from meshloom.config.errors import ConfigError
from meshloom.config.loader import load_config
from meshloom.models.registry import get_model_spec
from meshloom.parallel.apply import parallelize
from meshloom.planning.dry_run import dry_run
from meshloom.planning.run_plan import RunPlan
from meshloom.cli.checkpoint_commands import seed_checkpoint
from meshloom.testing.layout_parity import FP32_TOLERANCE
from meshloom.testing.resume_parity import Case, CaseResult, launch, run_case

REPO = Path(__file__).resolve().parents[1]
QWEN3_MOE = ["--model.name", "qwen3", "--model.flavor", "tiny_moe"]
# Both balance losses as well as the bias, except under context parallel (it refuses the sequence-wise loss).
MOE = QWEN3_MOE + ["--moe.aux_loss_coef", "1e-2", "--moe.z_loss_coef", "1e-3"]
MOE_CP = QWEN3_MOE + ["--moe.z_loss_coef", "1e-3"]
SAVE = ["--checkpoint.enable", "true", "--checkpoint.interval", "5"]
RESUME = SAVE + ["--checkpoint.resume", "true"]
COMPILE = ",compile.enable=true"
SAC = ",activation_checkpoint.mode=selective_op"

# DeepSeek-V3 `tiny` cut to 4 blocks (1 dense, 3 MoE) with its 2 MoE prediction modules, as in
# test_deepseek_v3_parallel.py: 32-token sequences, bias balancing at 10x DeepSeek's rate, the router z-loss.
DEEPSEEK = ["--model.name", "deepseek_v3", "--model.n_layers", "4", "--training.seq_len", "32"]
DEEPSEEK += ["--moe.bias_update_rate", "0.01", "--moe.z_loss_coef", "1e-3"]

# name -> (layout, reference): every case trains from the reference's initial weights, as many steps as it
# (REFERENCE_STEPS).
PARITY = {
    "ep2": ("dp_shard=2,ep=2", "ref"),
    "ep2_compile_sac": ("dp_shard=2,ep=2" + COMPILE + SAC, "ref_short"),
    "cp2_ep2": ("cp=2,ep=2,training.local_batch_size=4", "ref_cp"),  # and 2 accumulation steps
    "cp2_ep2_compile_sac": ("cp=2,ep=2" + COMPILE + SAC, "ref_cp_short"),
    "ep4_compile_sac": ("dp_shard=4,ep=4" + COMPILE + SAC, "ref_short"),
    "fsdp2_ep2_compile_sac": ("dp_shard=4,ep=2" + COMPILE + SAC, "ref_short"),
    "hsdp_ep2_compile_sac": ("dp_replicate=2,dp_shard=2,ep=2" + COMPILE + SAC, "ref_short"),
    "tp2_ep2_compile_sac": ("dp_shard=2,tp=2,ep=2" + COMPILE + SAC, "ref_short"),
    "pp2_ep2_compile_sac": ("pp=2,dp_shard=2,ep=2" + COMPILE + SAC, "ref_short"),
}
REFERENCE_STEPS = {"ref": 10, "ref_cp": 10, "ref_short": 6, "ref_cp_short": 6}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, data_cache: Path) -> dict[str, CaseResult]:
    os.environ.pop("WORLD_SIZE", None)
    w = tmp_path_factory.mktemp("ep")
    (w / "cache").symlink_to(data_cache)
    out: dict[str, CaseResult] = {}

    def local(case: Case) -> None:
        out[case.name] = run_case(case, w)

    for name, steps in REFERENCE_STEPS.items():
        local(Case(name, str(w / name), steps=steps, overrides=MOE_CP if name.startswith("ref_cp") else MOE))
    local(Case("ds_ref", str(w / "ds_ref"), overrides=DEEPSEEK))
    local(Case("1proc_stop", str(w / "1proc"), stop_after=5, overrides=MOE + SAVE))
    seed = seed_checkpoint(Case("seed", str(w / "seed")).argv(w) + MOE + ["--training.seed", "11"])
    from_seed = ["--checkpoint.initial_load_path", str(seed), "--parallelism.init", "sharded"]
    local(Case("seed_ref", str(w / "seed_ref"), steps=3, overrides=MOE + from_seed))

    cases = [
        Case(name, str(w / name), layout, REFERENCE_STEPS[reference], overrides=MOE_CP if reference.startswith("ref_cp") else MOE)
        for name, (layout, reference) in PARITY.items()
    ]
    cases += [
        Case("ep2_stop", str(w / "ep2_run"), "dp_shard=2,ep=2", stop_after=5, overrides=MOE + SAVE),
        Case("ep2_resume", str(w / "ep2_run"), "dp_shard=2,ep=2", overrides=MOE + RESUME),
        Case("1proc_to_ep2", str(w / "1proc"), "dp_shard=2,ep=2", overrides=MOE + RESUME),
        # The resume above saves step 10 into its folder: the 1-process resume needs a step-5 folder of its own.
        Case("ep2_stop_b", str(w / "ep2_run_b"), "dp_shard=2,ep=2", stop_after=5, overrides=MOE + SAVE),
        Case("seed_ep2", str(w / "seed_ep2"), "dp_shard=2,ep=2", steps=3, overrides=MOE + from_seed),
        # ep borrows from dp_shard: 4 routed experts per rank, tp splits MLA and the shared experts.
        Case("ds_fsdp2_ep2_tp2", str(w / "ds_fsdp2_ep2_tp2"), "dp_shard=2,tp=2,ep=2", overrides=DEEPSEEK),
    ]
    out.update(launch(cases, w))
    local(Case("ep2_to_1proc", str(w / "ep2_run_b"), overrides=MOE + RESUME))
    return out


def _max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.mark.parametrize("name", list(PARITY))
def test_expert_parallel_layouts_match_one_process(runs, name: str) -> None:
    reference, run = runs[PARITY[name][1]], runs[name]
    diff = _max_diff(run.losses, reference.losses)
    # Clipping (max_norm 1) never acts here, so the norms are compared on their own: experts and dense parameters
    # live on different meshes.
    norm_diff = _max_diff(run.grad_norms, reference.grad_norms)
    print(f"parity {name} ({PARITY[name][0]}): max |dloss| {diff:.2e}, max |dgrad_norm| {norm_diff:.2e}")
    assert diff <= FP32_TOLERANCE and norm_diff <= FP32_TOLERANCE, (name, reference.losses, run.losses)
    assert reference.losses[-1] < reference.losses[0] - 0.3  # it trained
    # The balancing bias moves by +-rate from counts summed exactly over the data-parallel ranks: bitwise the same.
    biases = [key for key in reference.final_state if key.startswith("model.") and key.endswith("moe.expert_bias")]
    assert len(biases) == 2 and all(run.final_state[key] == reference.final_state[key] for key in biases)


def test_deepseek_v3_fsdp2_ep2_tp2_matches_one_process(runs) -> None:
    reference, run = runs["ds_ref"], runs["ds_fsdp2_ep2_tp2"]
    diffs = {
        "loss": _max_diff(run.losses, reference.losses),
        "mtp_loss": _max_diff(run.aux["mtp_loss"], reference.aux["mtp_loss"]),
        "grad_norm": _max_diff(run.grad_norms, reference.grad_norms),
    }
    print("parity deepseek_v3 dp_shard=2,tp=2,ep=2: " + ", ".join(f"max |d{k}| {v:.2e}" for k, v in diffs.items()))
    assert all(diff <= FP32_TOLERANCE for diff in diffs.values()), (diffs, reference.losses, run.losses)
    assert len(reference.aux["mtp_loss"]) == 10 and reference.losses[-1] < reference.losses[0] - 0.3
    # Three MoE blocks and the two prediction modules' blocks, each bias bitwise the same as one process's.
    biases = [key for key in reference.final_state if key.startswith("model.") and key.endswith("moe.expert_bias")]
    assert len(biases) == 5 and all(run.final_state[key] == reference.final_state[key] for key in biases)


def test_resume_under_expert_parallel_is_bitwise_equal(runs) -> None:
    straight, stop, resume = runs["ep2"], runs["ep2_stop"], runs["ep2_resume"]
    assert stop.losses == straight.losses[:5] and resume.losses == straight.losses[5:]
    # Every weight, optimizer moment and balancing bias, gathered whole.
    assert resume.final_state and resume.final_state == straight.final_state
    assert any(".moe.experts.w1" in key and key.startswith("optimizer.") for key in straight.final_state)
    assert any(key.endswith("moe.expert_bias") for key in straight.final_state)


def test_checkpoints_reshard_between_expert_parallel_and_one_process(runs) -> None:
    reference = runs["ref"].losses
    assert _max_diff(runs["ep2_to_1proc"].losses, reference[5:]) <= FP32_TOLERANCE
    assert _max_diff(runs["1proc_to_ep2"].losses, reference[5:]) <= FP32_TOLERANCE


def test_seed_checkpoint_starts_an_expert_parallel_run(runs) -> None:
    assert _max_diff(runs["seed_ep2"].losses, runs["seed_ref"].losses) <= FP32_TOLERANCE
    # The seed (training.seed 11) replaced the run's own initialisation (seed 7, and sharded init differs too).
    assert abs(runs["seed_ref"].losses[0] - runs["ref"].losses[0]) > 1e-3


# --------------------------------------------------------------------------- mesh and errors (no training)


@contextlib.contextmanager
def _fake_parallelize(world: int, settings: list[str]):
    """Rank 0 of `world` on torch's fake process group: the meta model as parallelize leaves it, and the dims."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    plan = RunPlan.build(load_config(QWEN3_MOE + settings), world)
    dist.init_process_group(backend="fake", store=FakeStore(), rank=0, world_size=world)
    try:
        plan.dims.build_mesh("cpu")
        spec = get_model_spec("qwen3")
        with torch.device("meta"):
            yield parallelize(spec.model_cls(plan.model_args), plan), plan.dims
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("world", "settings", "ep_ranks", "expert_fsdp", "local_experts"),
    [
        # dp_shard 8 = efsdp 4 x ep 2, ep innermost: rank 0 holds experts 0-3, FSDP-sharded over 4 ranks.
        (8, ["--parallelism.ep", "2"], [0, 1], [0, 2, 4, 6], 1),
        # HSDP x TP: ep borrows from dp_shard only; its ranks sit tp apart, experts replicated over dp_replicate.
        (8, ["--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "2", "--parallelism.tp", "2", "--parallelism.ep", "2"], [0, 2], [[0], [4]], 4),
        # CP x EP: ep borrows a cp and a dp_shard rank (cp inner); 8 experts / 4 / FSDP 2 -> 1 expert per rank.
        (8, ["--parallelism.cp", "2", "--parallelism.ep", "4"], [0, 1, 2, 3], [0, 4], 1),
    ],
)
def test_experts_are_split_over_ep_and_sharded_over_the_rest(world, settings, ep_ranks, expert_fsdp, local_experts) -> None:
    with _fake_parallelize(world, settings) as (model, dims):
        experts = model.layers["0"].moe.experts
        assert isinstance(experts.w1, DTensor) and experts.w1.shape == (8, 64, 64)
        assert experts.w1.to_local().shape[0] == local_experts
        assert dims.mesh("ep").mesh.tolist() == ep_ranks
        assert dims.mesh("expert_fsdp").mesh.tolist() == expert_fsdp
        # Dense parameters keep the (dp_replicate, dp_shard x cp) mesh, with tp when present.
        assert model.layers["0"].attention.wq.weight.device_mesh.mesh.numel() == world
    # The memory estimator counts the same local shards, byte for byte.
    report = dry_run(load_config(QWEN3_MOE + settings), world)
    assert report.built_param_bytes == report.rank_params


@pytest.mark.parametrize(
    ("world", "settings", "message"),
    [
        (3, ["--parallelism.ep", "3"], r"parallelism.ep=3 does not divide the model's 8 routed experts"),
        (4, ["--parallelism.tp", "2", "--parallelism.ep", "4"], r"parallelism.ep=4 must divide dp_shard x cp = 2 x 1 = 2"),
        (2, ["--model.flavor", "tiny", "--parallelism.ep", "2"], r"with parallelism.ep > 1 \(EP\): expert parallel splits the routed experts"),
    ],
)
def test_expert_parallel_settings_the_shapes_forbid_are_config_errors(world, settings, message) -> None:
    with pytest.raises(ConfigError, match=message):
        RunPlan.build(load_config(QWEN3_MOE + settings), world)


def test_top_k_above_the_expert_count_is_refused() -> None:
    from meshloom.models.common.moe import MoEArgs

    with pytest.raises(ValueError, match=r"top_k=9 exceeds n_experts=8"):
        MoEArgs(n_experts=8, top_k=9, hidden_dim=64)


# --------------------------------------------------------------------------- planning


def test_dry_run_of_235b_a22b_with_ep_8_on_256_ranks(capsys) -> None:
    from meshloom.cli.train import main

    argv = [
        "--config", str(REPO / "configs" / "qwen3_moe_debug.toml"), "--model.flavor", "235B-A22B", "--parallelism.ep", "8",
        "--parallelism.tp", "4", "--parallelism.pp", "8", "--pipeline.microbatches", "8", "--training.seq_len", "4096",
        "--activation_checkpoint.mode", "full", "--dry-run", "--world-size", "256",
    ]  # fmt: skip
    assert main(argv) == 0
    report = capsys.readouterr().out
    print(report)
    built = float(re.search(r"parameters \(built shards\)\s+([\d.]+) GiB", report).group(1))
    estimated = float(re.search(r"parameters \(estimate\)\s+([\d.]+) GiB", report).group(1))
    assert built == estimated
    # Rank 0: 11 of 94 blocks (128 experts split over ep 8, each FSDP-sharded over dp_shard 8 / ep 8 = 1 rank) and
    # the embedding; without ep its experts would be sharded 8 ways too, so the shards are about as large.
    assert 0.8 < built * 2**30 / (4 * 235.09e9 / 8 / 8) < 1.3
    ep = float(re.search(r"\n\s+ep\s+([\d.]+) GiB", report).group(1))
    # All-to-all of the busiest stage (a middle stage's 12 blocks; the first holds 11 and the embedding): 8
    # microbatches x 12 MoE blocks x 6 exchanges (forward, backward, recomputed forward) x 7/8 of 4096 tokens x 4096
    # fp32 values x top 8 leave one rank.
    assert ep == pytest.approx(8 * 12 * 6 * 7 / 8 * 4096 * 4096 * 4 * 8 / 2**30, rel=0.01)


def test_memory_estimate_matches_a_measured_expert_parallel_run(tmp_path) -> None:
    """debug_moe shrunk to 2 blocks under EP 2 (gloo ranks, 2 steps): local shards of parameters, gradients and
    optimizer state exactly, the tracked activations within 20% of the estimate."""
    import argparse
    import importlib.util

    module_spec = importlib.util.spec_from_file_location("memory_estimate_benchmark", REPO / "benchmarks" / "memory_estimate.py")
    bench = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(bench)
    args = argparse.Namespace(flavor="debug_moe", seq_len=128, batch=2)
    ranks = bench.measure("model.name=qwen3,model.n_layers=2,dp_shard=2,ep=2", args, tmp_path, 0)
    assert not isinstance(ranks, str), ranks
    for result in ranks:
        for kind, tolerance in bench.TARGETS.items():
            measured, estimated = result["measured"][kind], result["estimated"][kind]
            assert abs(measured / estimated - 1) <= tolerance, (kind, measured, estimated)
