"""Activation checkpointing per transformer block: none, full, every k-th block, or selective by op.

A checkpointed block keeps only its inputs (and, selective by op, the outputs of the listed ops) in forward
and recomputes the rest in backward. The fifth mode, memory_budget, is not applied here: compile's
partitioner chooses what to keep (see `meshloom.parallel.compile`).

The block's `forward` is wrapped in place instead of wrapping the module, so parameter names stay
`layers.<i>.<module>.weight`: checkpoints, Hugging Face name maps and Float8 filters see the same model
whichever mode runs.
"""

from __future__ import annotations

import difflib
import functools
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import SAC_IGNORED_OPS, checkpoint, create_selective_checkpoint_contexts

from meshloom.config.errors import ConfigError
from meshloom.config.schema import ActivationCheckpointConfig

# Kept by "default": what is expensive to recompute (matmuls, attention kernels of every backend,
# Float8 matmuls and their amax reductions, tensor-parallel reduce-scatters), while norms, activations
# and RoPE are cheap to recompute and take most of the memory.
DEFAULT_SAVE_OPS = (
    "aten.mm.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_mm.default",
    "aten.max.default",
    "_c10d_functional.reduce_scatter_tensor.default",
)


# Profiler ranges are bookkeeping, not values: run them as they come in forward and in recomputation alike. An
# FSDP unit nested inside a checkpointed block (expert parallel's routed experts) opens one more range when it is
# recomputed in backward (it then takes the root's part, as no forward is under way), which selective AC would
# otherwise reject as a different op sequence.
SAC_IGNORED_OPS.update({
    torch.ops.profiler._record_function_enter_new.default,
    torch.ops.profiler._record_function_exit.default,
    torch.ops.profiler._record_function_exit._RecordFunction,
})


@functools.cache
def _registered_ops() -> frozenset[str]:
    """Every operator the dispatcher knows, as 'namespace::name' (overloads stripped)."""
    import torch.distributed  # noqa: F401  (registers the _c10d_functional ops)

    return frozenset(name.split(".")[0] for name in torch._C._dispatch_get_all_op_names())


def _unknown_op(name: str, reason: str) -> ConfigError:
    candidates = sorted(op.replace("::", ".") for op in _registered_ops())
    close = difflib.get_close_matches(name.rsplit(".", 1)[0] if name.count(".") > 1 else name, candidates, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return ConfigError(
        f"activation_checkpoint.save_ops names {reason} '{name}'{hint}; write ops as namespace.name[.overload], "
        f"e.g. aten.mm or aten._scaled_dot_product_flash_attention_for_cpu.default, or 'default'"
    )


def _resolve_op(name: str) -> list[torch._ops.OpOverload]:
    parts = name.split(".")
    if len(parts) not in (2, 3) or not all(parts):
        raise _unknown_op(name, "a malformed op")
    namespace, op_name = parts[0], parts[1]
    if f"{namespace}::{op_name}" not in _registered_ops():
        raise _unknown_op(name, "an unknown op")
    packet = getattr(getattr(torch.ops, namespace), op_name)
    if len(parts) == 2:
        return [getattr(packet, overload) for overload in packet.overloads()]
    if parts[2] not in packet.overloads():
        raise ConfigError(
            f"activation_checkpoint.save_ops: op {namespace}.{op_name} has no overload '{parts[2]}'; "
            f"choices: {', '.join(packet.overloads())}"
        )
    return [getattr(packet, parts[2])]


def resolve_save_ops(spec: str) -> list[torch._ops.OpOverload]:
    """Parse `save_ops` ("default", op names, or both, comma-separated) into operator overloads."""
    names = [item.strip() for item in spec.split(",") if item.strip()]
    if not names:
        raise ConfigError("activation_checkpoint.save_ops is empty; use 'default' or list ops such as aten.mm")
    ops: list[torch._ops.OpOverload] = []
    for name in names:
        for expanded in DEFAULT_SAVE_OPS if name == "default" else (name,):
            ops += [op for op in _resolve_op(expanded) if op not in ops]
    return ops


def check_activation_checkpoint_config(config: ActivationCheckpointConfig) -> None:
    """Bad settings as ConfigErrors, before anything is built (memory_budget's need of compile is declared in
    meshloom/planning/features.py)."""
    if config.mode == "selective_layer" and config.every_k_layers < 1:
        raise ConfigError(
            f"activation_checkpoint.every_k_layers must be >= 1, got {config.every_k_layers} (1 = every block, like full)"
        )
    if config.mode == "selective_op":
        resolve_save_ops(config.save_ops)
    if config.mode == "memory_budget":
        if not 0.0 <= config.memory_budget <= 1.0:
            raise ConfigError(
                f"activation_checkpoint.memory_budget must lie in [0, 1] (fraction of activations kept), got {config.memory_budget}"
            )


def _selective_context_fn(ops: list[torch._ops.OpOverload]) -> Callable:
    # A functools.partial, because that is the form torch.compile accepts as checkpoint's context_fn.
    return functools.partial(create_selective_checkpoint_contexts, ops)


def _checkpoint_forward(block: nn.Module, context_fn: Callable | None) -> None:
    inner = block.forward
    kwargs = {} if context_fn is None else {"context_fn": context_fn}

    @functools.wraps(inner)
    def forward(*args, **inputs):
        return checkpoint(inner, *args, use_reentrant=False, **kwargs, **inputs)

    block.forward = forward


def checkpointed_block_ids(config: ActivationCheckpointConfig, block_ids: list[int]) -> list[int]:
    """Which blocks (by their index in the whole model) this mode checkpoints."""
    if config.mode in ("full", "selective_op"):
        return list(block_ids)
    if config.mode == "selective_layer":
        return [i for i in block_ids if (i + 1) % config.every_k_layers == 0]
    return []


def apply_activation_checkpointing(layers: nn.ModuleDict, config: ActivationCheckpointConfig) -> None:
    """Checkpoint the blocks of `layers` (keyed by their index in the whole model, so a pipeline stage
    checkpoints the same blocks as the unsplit model)."""
    context_fn = _selective_context_fn(resolve_save_ops(config.save_ops)) if config.mode == "selective_op" else None
    for block_id in checkpointed_block_ids(config, [int(name) for name in layers]):
        _checkpoint_forward(layers[str(block_id)], context_fn)
