"""Test-only plugin (`model.plugin = "tests.qwen3_shared_experts"`): adds the qwen3 flavour `tiny_moe_shared`,
tiny_moe plus a shared expert, so that tensor parallel's split of shared experts is exercised next to expert
parallel (released Qwen3-MoE models have none)."""

import dataclasses

from meshloom.models.qwen3.flavors import QWEN3_FLAVORS

_TINY_MOE = QWEN3_FLAVORS["tiny_moe"]
QWEN3_FLAVORS.setdefault(
    "tiny_moe_shared", dataclasses.replace(_TINY_MOE, moe=dataclasses.replace(_TINY_MOE.moe, shared_hidden_dim=64))
)
