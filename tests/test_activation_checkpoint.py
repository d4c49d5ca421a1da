"""Activation checkpointing modes: same losses as no checkpointing, and each recomputes what it promises."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from meshloom.config.loader import ConfigError, load_config
from meshloom.config.schema import ActivationCheckpointConfig
from meshloom.models.llama3.flavors import LLAMA3_FLAVORS
from meshloom.models.llama3.model import Transformer
from meshloom.parallel.activation_checkpoint import (
    apply_activation_checkpointing,
    checkpointed_block_ids,
    resolve_save_ops,
)
from meshloom.testing.layout_parity import FP32_TOLERANCE, base_overrides, run_steps
from meshloom.train.trainer import Trainer

EAGER_MODES = {
    "full": ["--activation_checkpoint.mode", "full"],
    "selective_layer": ["--activation_checkpoint.mode", "selective_layer", "--activation_checkpoint.every_k_layers", "2"],
    "selective_op": ["--activation_checkpoint.mode", "selective_op"],
}


def test_every_eager_mode_keeps_loss_parity_with_none(tmp_path, data_cache):
    argv = base_overrides(4, tmp_path) + ["--job.dump_folder", str(tmp_path / "run"), "--data.cache_dir", str(data_cache)]
    reference = run_steps(argv)
    for name, extra in EAGER_MODES.items():
        curve = run_steps(argv + extra)
        diff = max(abs(a - b) for a, b in zip(reference.losses, curve.losses))
        assert diff <= FP32_TOLERANCE, f"{name}: loss differs from no checkpointing by {diff}"
        assert abs(reference.grad_norms[-1] - curve.grad_norms[-1]) <= FP32_TOLERANCE, name


def _training_flops(mode: str, every_k_layers: int = 2) -> int:
    """FLOPs of one forward + backward of the tiny model: recomputed matmuls show up as extra FLOPs."""
    torch.manual_seed(0)
    model = Transformer(LLAMA3_FLAVORS["tiny"])
    apply_activation_checkpointing(model.layers, ActivationCheckpointConfig(mode=mode, every_k_layers=every_k_layers))
    with FlopCounterMode(display=False) as counter:
        model(torch.randint(0, 512, (2, 32))).sum().backward()
    return counter.get_total_flops()


def test_modes_recompute_what_they_promise():
    none, full = _training_flops("none"), _training_flops("full")
    block_forward = (full - none) / 2  # full recomputes the forward of both blocks
    assert block_forward > 0
    # Every 2nd block of 2: only block 1 is recomputed.
    assert _training_flops("selective_layer") == pytest.approx(none + block_forward)
    assert _training_flops("selective_layer", every_k_layers=1) == full
    # Matmuls and attention are saved, so no matmul is run again.
    assert _training_flops("selective_op") == none


def test_selective_layer_picks_every_kth_block_by_global_index():
    config = ActivationCheckpointConfig(mode="selective_layer", every_k_layers=3)
    assert checkpointed_block_ids(config, list(range(8))) == [2, 5]
    # A pipeline stage holding blocks 4..7 checkpoints the same blocks as the whole model would.
    assert checkpointed_block_ids(config, [4, 5, 6, 7]) == [5]
    assert checkpointed_block_ids(ActivationCheckpointConfig(mode="none"), [0, 1]) == []


def test_default_save_ops_cover_cpu_and_cuda_attention():
    ops = {str(op) for op in resolve_save_ops("default")}
    for name in (
        "aten.mm.default",
        "aten._scaled_dot_product_flash_attention_for_cpu.default",
        "aten._scaled_dot_product_flash_attention.default",
        "aten._scaled_dot_product_efficient_attention.default",
        "aten._scaled_dot_product_cudnn_attention.default",
    ):
        assert name in ops
    # A packet name means all its overloads; "default" may be combined with extra ops.
    assert {"aten.addmm.default", "aten.addmm.out"} <= {str(op) for op in resolve_save_ops("default, aten.addmm")}


def _config_error(tmp_path, *extra: str) -> str:
    argv = base_overrides(2, tmp_path) + ["--job.dump_folder", str(tmp_path / "run"), *extra]
    with pytest.raises(ConfigError) as err:
        Trainer(load_config(argv))
    # Raised before any data was prepared.
    assert not (tmp_path / "cache").exists()
    return str(err.value)


def test_unknown_op_is_a_config_error_with_a_suggestion(tmp_path):
    message = _config_error(tmp_path, "--activation_checkpoint.mode", "selective_op", "--activation_checkpoint.save_ops", "aten.mm,aten.mmm")
    assert "activation_checkpoint.save_ops" in message and "'aten.mmm'" in message and "did you mean 'aten.mm'" in message
    message = _config_error(tmp_path, "--activation_checkpoint.mode", "selective_op", "--activation_checkpoint.save_ops", "aten.mm.nosuch")
    assert "no overload 'nosuch'" in message and "default" in message


def test_memory_budget_without_compile_is_a_config_error(tmp_path):
    message = _config_error(tmp_path, "--activation_checkpoint.mode", "memory_budget")
    assert "memory_budget" in message and "compile.enable = true" in message
