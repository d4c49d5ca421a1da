"""The toy family's parallel plan: tensor parallel, activation checkpointing, compile and FSDP, by its own names."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from meshloom.config.errors import ConfigError
from meshloom.parallel.activation_checkpoint import apply_activation_checkpointing
from meshloom.parallel.compile import apply_compile
from meshloom.parallel.dims import check_divisible
from meshloom.parallel.fsdp import apply_fsdp


def check_layout(args, dims) -> None:
    check_divisible("tp", dims.tp, {"n_heads": args.n_heads, "n_kv_heads": args.kv_heads, "vocab_size": args.vocab_size})
    if dims.cp > 1:
        raise ConfigError("the toy family has no context-parallel plan; set parallelism.cp = 1")


def carve_stage(model, layers: Sequence[int], first: bool, last: bool):
    keep = {str(i) for i in layers}
    for name in [name for name in model.layers if name not in keep]:
        del model.layers[name]
    if not first:
        model.wte = None
    if not last:
        model.ln_f = None
        model.lm_head = None
    return model


def _tensor_parallel(model, mesh, loss_parallel: bool) -> None:
    root = {}
    if model.wte is not None:
        root["wte"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.ln_f is not None:
        root["ln_f"] = SequenceParallel()
    if model.lm_head is not None:
        root["lm_head"] = ColwiseParallel(
            input_layouts=Shard(1), output_layouts=Shard(-1) if loss_parallel else Replicate(), use_local_output=not loss_parallel
        )
    parallelize_module(model, mesh, root)
    for block in model.layers.values():
        parallelize_module(block, mesh, {
            "ln_1": SequenceParallel(),
            "attn": PrepareModuleInput(input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)),
            "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ln_2": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.w1": ColwiseParallel(), "mlp.w3": ColwiseParallel(),
            "mlp.w2": RowwiseParallel(output_layouts=Shard(1)),
        })  # fmt: skip


def parallelize_toy(model, dims, config):
    if dims.tp > 1:
        _tensor_parallel(model, dims.mesh("tp"), config.parallelism.loss_parallel)
    apply_activation_checkpointing(model.layers, config.activation_checkpoint)
    if config.compile.enable:
        apply_compile(model.layers, config.activation_checkpoint)
    if dims.fsdp_enabled or dims.dp_replicate > 1:
        apply_fsdp(
            model, list(model.layers.values()), dims.mesh("fsdp"), param_dtype=torch.float32, reduce_dtype=torch.float32,
            reshard_after_forward=config.parallelism.fsdp_reshard_after_forward, cpu_offload=False,
        )  # fmt: skip
    return model
