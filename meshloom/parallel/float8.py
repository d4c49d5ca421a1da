"""Float8 training of the transformer blocks' linear layers with torchao's `convert_to_float8_training`.

- Recipes: tensorwise (one dynamic scale per tensor) and rowwise (one per row, more accurate).
- Skipped: the output projection (the logits are the most precision-sensitive matmul) and any linear whose
  dims are not multiples of 16 (what the float8 matmul kernels require). Under tensor parallel each rank
  multiplies a slice, so both dims divided by the TP degree must be multiples of 16 (conservative: only
  one of them is split, but which one is the model's TP plan's business).
- With FSDP and tensorwise, weights are all-gathered in float8 (half the bytes of bf16), and after each
  optimizer step one all-reduce computes the amax/scale of every float8 weight at once.

Float8 runs on CPU too (torch's `_scaled_mm` has a CPU kernel), about 4x slower than fp32, which is good
for correctness tests; the speed-up is on GPUs with float8 tensor cores (compute capability >= 8.9).
"""

from __future__ import annotations

import torch
from torch import nn

from meshloom.config.errors import ConfigError
from meshloom.config.schema import Float8Config

# How far the loss of a Float8 run may drift from the same run in bf16 over the few steps the tests train (the parity
# harness's tiny model: seq 64, batch 8, lr 1e-2). Float8 (e4m3) keeps 3 mantissa bits to bf16's 7, so each matmul
# is noisier and the runs slowly part. Measured on CPU (torch 2.13, torchao, 2026-11-30), max |dloss| vs bf16:
# 1 process over 6 steps 1.7e-3 (tensorwise) and 2.5e-3 (rowwise); FSDP 2 over 5 steps 1.1e-3 and 1.3e-3. The bound
# is twice the largest. The drift keeps growing with steps (5.4e-3 after 10), so it holds for a few steps only;
# a broken cast or scale moves the loss by far more.
FLOAT8_LOSS_BOUND_VS_BF16 = 5e-3
# Float8 matmuls need both dims of the weight to be multiples of this.
FLOAT8_DIM_MULTIPLE = 16
# Only the blocks' linears (`layers.<i>...`, the ModelSpec contract) are converted: the embedding and the
# vocabulary projection stay in high precision.
BLOCKS_PREFIX = "layers."


def _usable(linear: nn.Linear, tp: int) -> bool:
    return all(
        size % tp == 0 and (size // tp) % FLOAT8_DIM_MULTIPLE == 0 for size in (linear.in_features, linear.out_features)
    )


def _is_skipped(fqn: str) -> bool:
    return not fqn.startswith(BLOCKS_PREFIX)


def float8_targets(model: nn.Module, tp: int = 1) -> tuple[list[str], list[str]]:
    """(converted, skipped-for-dims) linear layer names of `model` (which may live on the meta device)."""
    converted, unusable = [], []
    for fqn, module in model.named_modules():
        if isinstance(module, nn.Linear) and not _is_skipped(fqn):
            (converted if _usable(module, tp) else unusable).append(fqn)
    return converted, unusable


def check_float8_config(config: Float8Config, model: nn.Module, tp: int) -> None:
    """Bad settings as ConfigErrors; `model` may be a meta-device copy (only shapes are read). The GPU's own float8
    support is a kernel condition (meshloom/planning/kernels.py)."""
    if not config.enable:
        return
    converted, unusable = float8_targets(model, tp)
    if not converted:
        shapes = ", ".join(
            f"{fqn} ({model.get_submodule(fqn).in_features}x{model.get_submodule(fqn).out_features})" for fqn in unusable[:4]
        )
        raise ConfigError(
            f"float8.enable: no linear layer can run in float8, because float8 matmuls need dims (per tensor-parallel "
            f"rank: divided by tp={tp}) that are multiples of {FLOAT8_DIM_MULTIPLE}, and this model has "
            f"{shapes or 'no linear layers besides the output'}; pick a model flavor whose sizes are multiples of "
            f"{FLOAT8_DIM_MULTIPLE * tp}, lower parallelism.tp, or set float8.enable = false"
        )


def _linear_config(config: Float8Config, fsdp: bool):
    from torchao.float8 import Float8LinearConfig

    if config.recipe == "rowwise":
        return Float8LinearConfig.from_recipe_name("rowwise")
    # The float8 all-gather casts each weight shard with a scale shared by the whole weight: tensorwise only.
    return Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp and config.fsdp_float8_all_gather)


def convert_to_float8(model: nn.Module, config: Float8Config, fsdp: bool, tp: int) -> list[str]:
    """Swap the usable linears for torchao's Float8Linear in place; returns the converted names."""
    from torchao.float8 import convert_to_float8_training

    converted, _ = float8_targets(model, tp)
    targets = set(converted)
    convert_to_float8_training(
        model, module_filter_fn=lambda module, fqn: fqn in targets, config=_linear_config(config, fsdp)
    )
    return converted


def uses_float8_all_gather(config: Float8Config, fsdp: bool) -> bool:
    return config.enable and config.recipe == "tensorwise" and config.fsdp_float8_all_gather and fsdp


def sync_float8_scales(model: nn.Module, config: Float8Config, fsdp: bool) -> None:
    """After the optimizer step: one all-reduce of every float8 weight's amax, for the next step's all-gathers."""
    if uses_float8_all_gather(config, fsdp):
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(model)
