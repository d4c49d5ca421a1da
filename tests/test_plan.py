"""Planning without a cluster: the dry run on the fake process group, the memory estimator and `meshloom plan`."""

from __future__ import annotations

import dataclasses

import pytest

from meshloom.config.loader import ConfigError, load_config
from meshloom.models.registry import get_model_args, get_model_spec
from meshloom.planning.dry_run import dry_run, split_dry_run_args
from meshloom.planning.layout import Layout, Precision, layout_of
from meshloom.planning.memory_estimate import estimate_memory
from meshloom.planning.planner import Cluster, plan
from meshloom.planning.run_plan import RunPlan
from meshloom.cli.plan import main as plan_main


def _shape(flavor: str):
    return get_model_spec("llama3").shape_model(get_model_args("llama3", flavor))


def _config(*overrides: str):
    return load_config(["--training.mixed_precision", "bf16", *overrides])


@pytest.mark.parametrize(
    "world_size, overrides",
    [
        (8, ["--model.flavor", "debug"]),  # FSDP 8
        (8, ["--model.flavor", "tiny", "--parallelism.tp", "4"]),  # FSDP 2 x TP 4, uneven FSDP chunks
        (16, ["--model.flavor", "debug", "--parallelism.dp_replicate", "2", "--parallelism.tp", "2"]),  # HSDP x TP
        (16, ["--model.flavor", "8B", "--parallelism.tp", "8", "--parallelism.cp", "2", "--training.seq_len", "512"]),
        (32, ["--model.flavor", "8B", "--parallelism.tp", "4", "--parallelism.pp", "4", "--training.local_batch_size", "4"]),
    ],
)
def test_dry_run_parameter_shards_match_the_estimate(world_size, overrides):
    report = dry_run(_config(*overrides), world_size)
    assert report.built_param_bytes == report.rank_params
    assert report.memory.peak > report.memory.params


def test_dry_run_405b_on_512_ranks_is_fast_and_sharded():
    config = _config(
        "--model.flavor", "405B", "--training.seq_len", "8192", "--training.local_batch_size", "16",
        "--parallelism.tp", "8", "--parallelism.pp", "8", "--pipeline.microbatches", "16",
    )
    report = dry_run(config, 512)
    assert report.seconds < 60
    total = get_model_args("llama3", "405B")
    # Rank 0 holds its stage's blocks and the embedding: about 1/512 of the model, in fp32.
    assert report.built_param_bytes == report.rank_params
    assert 0.8 < report.built_param_bytes / (4 * 405.85e9 / 512) < 1.2
    assert set(report.comm_bytes) == {"tp", "cp", "dp_shard", "dp_replicate", "pp", "ep"}
    assert report.comm_bytes["tp"] > 0 and report.comm_bytes["dp_shard"] > 0 and report.comm_bytes["pp"] > 0
    assert report.model_flops > 0 and total.n_layers == 126


def test_dry_run_rejects_a_world_size_the_layout_cannot_use():
    with pytest.raises(ConfigError, match="does not divide the world size 12"):
        dry_run(_config("--model.flavor", "8B", "--parallelism.tp", "8"), 12)
    with pytest.raises(ConfigError, match="dp_replicate=1 x dp_shard=4 x tp=2"):
        dry_run(_config("--model.flavor", "8B", "--parallelism.tp", "2", "--parallelism.dp_shard", "4"), 16)
    with pytest.raises(ConfigError, match="--world-size"):
        split_dry_run_args(["--dry-run", "--model.flavor", "8B"])


def test_memory_per_rank_falls_with_every_sharding_degree():
    args = _shape("70B")
    base = Layout(dp_shard=2, tp=2, pp=2, cp=2, ac="selective_op", microbatch_size=1, microbatches=8)
    precision = Precision("bf16")
    before = estimate_memory(args, base, 8192, precision)
    for degree in ("dp_shard", "tp", "pp", "cp"):
        after = estimate_memory(args, dataclasses.replace(base, **{degree: 2 * getattr(base, degree)}), 8192, precision)
        assert after.peak < before.peak, degree
        if degree != "cp":
            assert after.params < before.params, degree
    checkpointed = estimate_memory(args, dataclasses.replace(base, ac="full"), 8192, precision)
    unchecked = estimate_memory(args, dataclasses.replace(base, ac="none"), 8192, precision)
    assert checkpointed.activations < before.activations < unchecked.activations


def test_cpu_kernels_add_mla_softmax_probabilities_and_nothing_for_equal_heads():
    """On CPU, SDPA's math path runs MLA (value heads narrower than query/key heads) and keeps heads x seq softmax
    probabilities per token, less the log-sum-exp a fused kernel keeps; equal heads have a fused CPU kernel, and
    context parallel's ring attention keeps no probabilities on any device."""
    seq, layout = 128, Layout(microbatch_size=2)
    deepseek = get_model_spec("deepseek_v3").shape_model(get_model_args("deepseek_v3", "debug"))
    gpu = estimate_memory(deepseek, layout, seq, Precision()).activations
    cpu = estimate_memory(deepseek, layout, seq, Precision(device="cpu")).activations
    heads, blocks = 8, deepseek.n_layers + 1  # + the prediction module's block
    assert cpu - gpu == pytest.approx(blocks * 2 * seq * heads * (4 * seq - 4), rel=1e-9)
    with_cp = dataclasses.replace(layout, cp=2)
    assert estimate_memory(deepseek, with_cp, seq, Precision(device="cpu")).activations == estimate_memory(deepseek, with_cp, seq, Precision()).activations
    llama = _shape("debug")
    cpu_llama, gpu_llama = estimate_memory(llama, layout, seq, Precision(device="cpu")), estimate_memory(llama, layout, seq, Precision())
    assert cpu_llama.activations == gpu_llama.activations
    # The peak differs by the CPU's foreach AdamW step only: one more fp32 copy of the parameters.
    assert cpu_llama.peak - gpu_llama.peak <= cpu_llama.params
    # training.device "auto" counts GPU kernels: layouts are dry-run on hosts without the GPUs they are for.
    assert dry_run(load_config(["--model.name", "deepseek_v3", "--model.flavor", "debug"]), 1).kernels == "cuda"
    assert dry_run(load_config(["--model.name", "deepseek_v3", "--model.flavor", "debug", "--training.device", "cpu"]), 1).kernels == "cpu"


def test_plan_picks_pure_fsdp_for_8b_on_8_gpus():
    best = plan("8B", Cluster(gpus=8, gpus_per_node=8, memory_gib=80), seq_len=8192, global_batch=8)[0].layout
    assert (best.dp_shard, best.dp_replicate, best.tp, best.pp, best.cp) == (8, 1, 1, 1, 1)


def test_plan_needs_tensor_and_pipeline_parallel_for_405b_on_512_gpus():
    best = plan("405B", Cluster(gpus=512, gpus_per_node=8, memory_gib=80), seq_len=8192, global_batch=1024)[0].layout
    assert best.tp > 1 and best.pp > 1
    assert best.world_size == 512


def test_plan_writes_a_config_that_loads_back_to_the_same_layout(tmp_path, capsys):
    out = tmp_path / "layout.toml"
    code = plan_main(["--flavor", "70B", "--gpus", "64", "--global-batch", "128", "--output", str(out), "--top", "3"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "layouts fit" in printed and f"wrote {out}" in printed
    best = plan("70B", Cluster(gpus=64, gpus_per_node=8, memory_gib=80), seq_len=8192, global_batch=128)[0].layout
    config = load_config(["--config", str(out)])
    assert config.model.flavor == "70B" and config.training.seq_len == 8192
    assert layout_of(RunPlan.build(config, 64)) == best


def test_plan_bad_input_names_the_fix(capsys):
    with pytest.raises(ValueError, match=r"at least [0-9.]+ GiB"):
        plan("405B", Cluster(gpus=8, gpus_per_node=8, memory_gib=80), seq_len=8192, global_batch=8)
    with pytest.raises(ValueError, match="data-parallel degree must divide the batch"):
        plan("tiny", Cluster(gpus=16, gpus_per_node=8, memory_gib=80), seq_len=256, global_batch=1)
    with pytest.raises(ValueError, match="whole number of 8-GPU nodes"):
        plan("8B", Cluster(gpus=12, gpus_per_node=8, memory_gib=80), seq_len=8192, global_batch=12)
    assert plan_main(["--flavor", "8B", "--gpus", "0", "--global-batch", "8"]) == 2
    assert "--gpus must be positive" in capsys.readouterr().err


def test_selective_layer_estimate_lies_between_none_and_full():
    args = _shape("8B")
    precision = Precision("bf16")

    def activations(ac: str, every_k_layers: int = 1) -> int:
        layout = Layout(dp_shard=8, ac=ac, every_k_layers=every_k_layers)
        return estimate_memory(args, layout, 8192, precision).activations

    assert activations("selective_layer", 1) == activations("full")
    assert activations("selective_layer", args.n_layers + 1) == activations("none")
    assert activations("full") < activations("selective_layer", 2) < activations("selective_layer", 4) < activations("none")


def test_estimate_matches_tracked_memory_of_real_runs(tmp_path):
    """FSDP 2 with full checkpointing, TP 2 with selective_op, PP 2, and one process checkpointing every second
    block, on forked gloo ranks: local shards (exactly) and the memory tracker's activations (recomputation included,
    within 20%) vs the estimate."""
    import argparse
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "memory_estimate.py"
    module_spec = importlib.util.spec_from_file_location("memory_estimate_benchmark", path)
    bench = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(bench)
    args = argparse.Namespace(flavor="tiny", seq_len=128, batch=2)
    layouts = (
        "dp_shard=2,activation_checkpoint.mode=full",
        "tp=2,activation_checkpoint.mode=selective_op",
        "pp=2,pipeline.schedule=GPipe,pipeline.microbatches=1",
        "activation_checkpoint.mode=selective_layer,activation_checkpoint.every_k_layers=2",
    )
    for layout, ranks in bench.measure_and_estimate(list(layouts), args, tmp_path).items():
        assert not isinstance(ranks, str), f"{layout}: {ranks}"
        for result in ranks:
            # The whole peak is held to its bound on the table's cells (tests/test_memory_estimate_table.py).
            for kind, tolerance in ((k, t) for k, t in bench.TARGETS.items() if k != "peak"):
                measured, estimated = result["measured"][kind], result["estimated"][kind]
                assert abs(measured / estimated - 1) <= tolerance, (layout, kind, measured, estimated)
