"""What only a GPU can show: NCCL parity, async TP, Float8, fused AdamW and the chunked loss on CUDA, and the
allocator's memory snapshot.

Every test carries the `cuda` marker: it runs when torch.cuda.is_available() and is skipped with the reason
otherwise (tests/conftest.py). The multi-GPU ones also skip, saying so, on a host with a single GPU. The same
tiny model and settings as the CPU suite, so each takes seconds on a GPU.
"""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from meshloom.config.loader import load_config
from meshloom.parallel.float8 import FLOAT8_LOSS_BOUND_VS_BF16
from meshloom.testing.layout_parity import FP32_TOLERANCE, base_overrides, compare
from meshloom.train.trainer import Trainer

pytestmark = pytest.mark.cuda

CUDA = ["--training.device", "cuda"]


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


needs_two_gpus = pytest.mark.skipif(_gpus() < 2, reason="needs 2 CUDA GPUs for an NCCL process group")


def _losses(argv: list[str], steps: int) -> tuple[Trainer, list[float]]:
    trainer = Trainer(load_config(argv))
    return trainer, [trainer.train_step().loss for _ in range(steps)]


@needs_two_gpus
def test_nccl_layouts_match_one_gpu(tmp_path):
    """FSDP 2 and TP 2 over NCCL against a 1-GPU fp32 reference (torch leaves TF32 matmuls off, and so does meshloom)."""
    os.environ.pop("WORLD_SIZE", None)
    reference, comparisons = compare(["dp_shard=2", "tp=2"], steps=10, workdir=tmp_path, common="training.device=cuda")
    assert reference.losses[-1] < reference.losses[0] - 0.3
    for c in comparisons:
        # CUDA kernels sum in other orders than on CPU (and atomics in the embedding backward), so allow 10x fp32's.
        assert c.max_loss_diff <= 10 * FP32_TOLERANCE and c.grad_norm_diff <= 10 * FP32_TOLERANCE, (c.layout.spec, c.max_loss_diff)


@needs_two_gpus
def test_async_tp_trains_like_plain_tp(tmp_path):
    """Inductor's micro-pipeline TP pass reorders the TP collectives around the matmuls; the loss must not move."""
    os.environ.pop("WORLD_SIZE", None)
    layouts = ["tp=2,compile.enable=true", "tp=2,compile.enable=true,compile.async_tp=true"]
    _, (plain, async_tp) = compare(layouts, steps=5, workdir=tmp_path, common="training.device=cuda")
    diff = max(abs(a - b) for a, b in zip(plain.curve.losses, async_tp.curve.losses))
    assert diff <= 1e-4, (plain.curve.losses, async_tp.curve.losses)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="Float8 matmuls need a GPU of compute capability 8.9 or newer",
)
def test_float8_on_cuda_trains_close_to_bf16(tmp_path, data_cache):
    argv = base_overrides(6, tmp_path) + CUDA + ["--data.cache_dir", str(data_cache), "--training.mixed_precision", "bf16"]
    _, bf16 = _losses(argv + ["--job.dump_folder", str(tmp_path / "bf16")], 6)
    for recipe in ("tensorwise", "rowwise"):
        run = ["--float8.enable", "true", "--float8.recipe", recipe, "--job.dump_folder", str(tmp_path / recipe)]
        _, float8 = _losses(argv + run, 6)
        diff = max(abs(a - b) for a, b in zip(bf16, float8))
        assert 0 < diff <= FLOAT8_LOSS_BOUND_VS_BF16, (recipe, diff)


def test_fused_adamw_is_the_cuda_default_and_matches_foreach(tmp_path, data_cache):
    argv = base_overrides(5, tmp_path) + CUDA + ["--data.cache_dir", str(data_cache)]
    fused, fused_losses = _losses(argv + ["--job.dump_folder", str(tmp_path / "fused")], 5)
    assert fused.optimizer.defaults["fused"] is True  # optimizer.implementation = "auto" picks it on CUDA
    foreach, foreach_losses = _losses(argv + ["--optimizer.implementation", "foreach", "--job.dump_folder", str(tmp_path / "f")], 5)
    assert foreach.optimizer.defaults["foreach"] is True
    assert fused_losses[0] == foreach_losses[0]  # the same first forward
    assert max(abs(a - b) for a, b in zip(fused_losses, foreach_losses)) <= FP32_TOLERANCE


def test_cuda_memory_snapshot_is_written_after_the_profiled_window(tmp_path, data_cache):
    run = tmp_path / "run"
    argv = base_overrides(4, tmp_path) + CUDA + [
        "--data.cache_dir", str(data_cache), "--job.dump_folder", str(run),
        "--profiling.memory_snapshot", "true", "--profiling.start_step", "2", "--profiling.num_steps", "2",
    ]  # fmt: skip
    Trainer(load_config(argv)).train()
    snapshot = run / "memory_snapshot" / "rank0_step3.pickle"
    assert sorted(p.name for p in (run / "memory_snapshot").iterdir()) == [snapshot.name]
    with open(snapshot, "rb") as f:  # written by torch.cuda.memory._dump_snapshot in this test
        data = pickle.load(f)
    assert data["segments"] and any(trace for trace in data["device_traces"])  # allocations were recorded


FAMILIES = [
    ("llama3", "tiny"), ("qwen3", "tiny_moe"), ("deepseek_v3", "tiny"), ("gpt_oss", "tiny"), ("qwen3_next", "tiny"),
]


@pytest.mark.parametrize(("family", "flavor"), FAMILIES)
def test_every_family_trains_compiled_in_bf16_on_cuda(tmp_path, data_cache, family, flavor):
    """What training runs: the Trainer, bf16, compile, forward and backward, three optimizer steps, each MoE family's
    routed experts with moe.grouped_mm = 'auto' (grouped on sm90+), and the kernel the plan chose for each block."""
    argv = base_overrides(3, tmp_path) + CUDA + [
        "--data.cache_dir", str(data_cache), "--training.mixed_precision", "bf16", "--compile.enable", "true",
        "--model.name", family, "--model.flavor", flavor,
    ]  # fmt: skip
    trainer, losses = _losses(argv, 3)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
    experts = [m for m in trainer.model.modules() if hasattr(m, "grouped_mm")]
    if family in ("qwen3", "deepseek_v3", "gpt_oss"):
        assert experts and all(m.grouped_mm is (torch.cuda.get_device_capability() >= (9, 0)) for m in experts)
        assert all(m.compute_dtype is torch.bfloat16 for m in experts)
    assert trainer.plan.kernels.lines, "the start-up summary names each block's kernel"


def test_chunked_loss_trains_like_whole_logits_compiled_in_bf16_on_cuda(tmp_path, data_cache):
    """What a GPU run of the chunked loss runs: the Trainer, bf16, compiled blocks, the chunked head between them
    (chunks of 100 tokens over 512, a remainder included); 5 steps close to whole logits."""
    from meshloom.testing.layout_parity import BF16_TOLERANCE

    argv = base_overrides(5, tmp_path) + CUDA + [
        "--data.cache_dir", str(data_cache), "--training.mixed_precision", "bf16", "--compile.enable", "true",
    ]  # fmt: skip
    _, whole = _losses(argv + ["--job.dump_folder", str(tmp_path / "whole")], 5)
    chunked_run = ["--loss.chunked", "true", "--loss.chunk_tokens", "100", "--job.dump_folder", str(tmp_path / "chunked")]
    _, chunked = _losses(argv + chunked_run, 5)
    assert max(abs(a - b) for a, b in zip(whole, chunked)) <= BF16_TOLERANCE, (whole, chunked)
    assert chunked[-1] < chunked[0]
