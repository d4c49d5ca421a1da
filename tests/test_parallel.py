"""Layout validation and the launcher: bad layouts fail clearly on every rank, good runs exit 0."""

import dataclasses
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshloom.config import ConfigError, ParallelismConfig, load_config
from meshloom.models.registry import get_model_args, get_model_spec
from meshloom.parallel.apply import parallelize
from meshloom.parallel.dims import ParallelDims
from meshloom.planning.run_plan import RunPlan

from conftest import REPO


def dims(world_size: int, **degrees) -> ParallelDims:
    return ParallelDims.from_config(ParallelismConfig(**degrees), world_size)


def test_dp_shard_is_inferred_from_the_world_size():
    assert dims(8, tp=2).dp_shard == 4
    assert dims(8, dp_replicate=2, tp=2).dp_shard == 2
    assert dims(1).dp_shard == 1
    assert dims(4, dp_shard=4).fsdp_enabled


@pytest.mark.parametrize(
    "world, degrees, message",
    [
        (4, dict(dp_shard=2, tp=4), "= 8, but the world size is 4; launch 8 ranks (NPROC=8)"),
        (8, dict(dp_shard=2, tp=2), "= 4, but the world size is 8; set parallelism.dp_shard = -1"),
        (6, dict(tp=4), "does not divide the world size 6"),
        (2, dict(tp=4), "launch a multiple of 4 ranks"),
    ],
)
def test_degrees_that_do_not_fit_the_world(world, degrees, message):
    with pytest.raises(ConfigError) as err:
        dims(world, **degrees)
    assert message in str(err.value)


def test_model_shape_checks():
    """The family's layout checks (heads, kv heads, vocabulary, FFN divisible by tp) and the generic ones (ep on a
    dense model), as the run plan applies them."""
    spec, args = get_model_spec("llama3"), get_model_args("llama3", "tiny")
    with pytest.raises(ConfigError, match=r"tp=3 does not divide the model's n_heads=8"):
        spec.check_layout(args, load_config([]), dims(3, tp=3))
    with pytest.raises(ConfigError, match="n_kv_heads=4"):
        spec.check_layout(args, load_config([]), dims(8, tp=8))
    with pytest.raises(ConfigError, match="vocab_size=511"):
        spec.check_layout(dataclasses.replace(args, vocab_size=511), load_config([]), dims(2, tp=2))
    with pytest.raises(ConfigError, match=r"with parallelism.ep > 1 \(EP\): expert parallel splits the routed experts"):
        RunPlan.build(load_config(["--model.flavor", "tiny", "--parallelism.ep", "2", "--parallelism.dp_shard", "2"]), 2)
    spec.check_layout(args, load_config([]), dims(4, tp=4))


def _launch(nproc: int, overrides: list[str], env: dict, cwd: Path) -> subprocess.CompletedProcess:
    """run_train.sh called from `cwd` (not the repository), with a recipe and folders relative to it."""
    # The debug recipe without its [validation] section: these runs turn validation off, where its settings would be
    # refused as idle.
    recipe = (REPO / "configs" / "llama3_debug.toml").read_text()
    (cwd / "my.toml").write_text(re.sub(r"\[validation\]\n(?:[^\[\n].*\n)*", "", recipe))
    args = [
        "--model.flavor", "tiny", "--training.steps", "3", "--training.seq_len", "64",
        "--training.local_batch_size", "2", "--data.max_bytes", "300000", "--data.vocab_size", "512",
        "--data.cache_dir", "cache", "--job.dump_folder", "run",
        "--metrics.progress_bar", "false", "--metrics.log_freq", "1", "--metrics.peak_tflops", "1",
        "--validation.enable", "false", *overrides,
    ]  # fmt: skip
    env = {**env, "NPROC": str(nproc), "MESHLOOM_BIN": str(Path(sys.executable).parent)}
    return subprocess.run(
        ["bash", str(REPO / "scripts" / "run_train.sh"), "--config", "my.toml", *args],
        env=env, capture_output=True, text=True, timeout=300, cwd=cwd,
    )


def test_launcher_runs_fsdp_and_exits_zero_then_refuses_bad_layouts(subprocess_env, tmp_path):
    ok = _launch(2, [], subprocess_env, tmp_path)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert ok.stdout.count("step 3 |") == 1  # only rank 0 logs
    # Relative paths were read from the caller's directory.
    assert (tmp_path / "run" / "metrics.jsonl").is_file() and list((tmp_path / "cache").glob("tokens-*.npy"))

    too_few = _launch(2, ["--parallelism.tp", "4"], subprocess_env, tmp_path)
    assert too_few.returncode != 0
    # every rank names the problem, before any model is built
    assert too_few.stderr.count("launch a multiple of 4 ranks") >= 2, too_few.stderr[-3000:]

    if not torch.cuda.is_available():  # on a GPU host this layout simply trains on CUDA
        cuda_only = _launch(2, ["--training.device", "cuda"], subprocess_env, tmp_path)
        assert cuda_only.returncode != 0
        assert "training.device = 'cuda' but no CUDA device is visible" in cuda_only.stderr


def _printed_launch(args: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
    env = {**env, "MESHLOOM_PRINT_LAUNCH": "1", "MESHLOOM_BIN": "/opt/bin", "NPROC": "2"}
    return subprocess.run(["bash", str(REPO / "scripts" / "run_train.sh"), *args], env=env, capture_output=True, text=True, cwd=cwd)


def test_launcher_reads_the_recipe_from_the_callers_directory(subprocess_env, tmp_path):
    (tmp_path / "r.toml").write_text("[training]\nsteps = 2\n")
    expected = "/opt/bin/torchrun --standalone --nproc-per-node 2 --max-restarts 0 -m meshloom.train --config r.toml --training.steps 5"
    for recipe in (["r.toml"], ["--config", "r.toml"], ["--config=r.toml"]):
        proc = _printed_launch([*recipe, "--training.steps", "5"], tmp_path, subprocess_env)
        assert proc.returncode == 0 and proc.stdout.strip() == expected, (recipe, proc.stdout, proc.stderr)
    # Without a recipe the repository's debug recipe is used, and every argument is an override.
    proc = _printed_launch(["--training.steps", "5"], tmp_path, subprocess_env)
    assert f"--config {REPO / 'configs' / 'llama3_debug.toml'} --training.steps 5" in proc.stdout
    # A recipe that is not there (here: only in the repository) is named with the directory it was looked for in.
    proc = _printed_launch(["configs/llama3_debug.toml"], tmp_path, subprocess_env)
    assert proc.returncode == 2 and f"config file configs/llama3_debug.toml not found (relative paths are read from {tmp_path})" in proc.stderr


def test_tensor_parallel_keeps_a_tied_llama_output_tied():
    """Each TP style replaces its own weight; parallelize ties the output to the sharded embedding again (meta model,
    one rank of two in torch's fake process group)."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    plan = RunPlan.build(load_config(["--model.flavor", "1B", "--model.n_layers", "1", "--parallelism.tp", "2"]), 2)
    dist.init_process_group(backend="fake", store=FakeStore(), rank=0, world_size=2)
    try:
        plan.dims.build_mesh("cpu")
        with torch.device("meta"):
            model = parallelize(plan.spec.model_cls(plan.model_args), plan)
    finally:
        dist.destroy_process_group()
    assert model.output.weight is model.tok_embeddings.weight
    assert model.output.weight.to_local().shape == (128256 // 2, 2048)
