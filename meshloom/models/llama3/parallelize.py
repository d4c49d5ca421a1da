"""The one place where parallelism is applied to Llama 3, in a fixed order: Float8, TP/SP, CP, AC, compile, FSDP.

Also what the degrees require of the shapes (`check_layout`) and how a pipeline stage is cut (`carve_stage`).
"""

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
from meshloom.config.schema import Config
from meshloom.models.llama3.model import Llama3Args, Transformer
from meshloom.parallel.activation_checkpoint import apply_activation_checkpointing
from meshloom.parallel.compile import apply_compile, enable_async_tp, set_cache_dir
from meshloom.parallel.context import RingAttentionCore, SequenceLayout, positions_hook
from meshloom.parallel.document_balance import context_layout
from meshloom.parallel.dims import ParallelDims, check_divisible
from meshloom.parallel.float8 import convert_to_float8
from meshloom.parallel.fsdp import apply_fsdp

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def check_layout(args: Llama3Args, dims: ParallelDims) -> None:
    """Every tensor-parallel rank must get whole heads, kv heads, vocabulary rows and FFN rows."""
    check_divisible("tp", dims.tp, {
        "n_heads": args.n_heads, "n_kv_heads": args.kv_heads, "vocab_size": args.vocab_size, "ffn_hidden_dim": args.ffn_hidden_dim,
    })  # fmt: skip
    if dims.pp > 1 and args.tie_embeddings:
        raise ConfigError(
            "this model ties its output projection to the embedding, but pipeline parallelism puts them on different "
            "stages; use an untied model flavour or set parallelism.pp = 1"
        )


def carve_stage(model: Transformer, layers: Sequence[int], first: bool, last: bool) -> Transformer:
    """Keep only one stage's part of a (meta-device) model: its blocks, plus the embedding on the first stage and the
    final norm and output projection on the last. Block names keep their global index."""
    keep = {str(i) for i in layers}
    for name in [name for name in model.layers if name not in keep]:
        del model.layers[name]
    if not first:
        model.tok_embeddings = None
    if not last:
        model.norm = None
        model.output = None
    return model


def apply_tensor_parallel(model: Transformer, tp_mesh, loss_parallel: bool) -> None:
    """Megatron-style column/row split of each block, with the activations between blocks sharded on sequence."""
    root_plan = {}
    if model.tok_embeddings is not None:
        # Embedding rows (vocabulary) are split; its output leaves sequence-sharded for the first norm.
        root_plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.norm is not None:
        root_plan["norm"] = SequenceParallel()
    if model.output is not None:
        root_plan["output"] = ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    parallelize_module(model, tp_mesh, root_plan)
    if model.args.tie_embeddings and model.tok_embeddings is not None and model.output is not None:
        # Each style replaced its own weight; both are the same vocabulary-row shards, so tie them again.
        model.output.weight = model.tok_embeddings.weight

    for block in model.layers.values():
        block_plan = {
            "attention_norm": SequenceParallel(),
            # Attention and MLP need the whole sequence: gather it on the way in (cos/sin stay local tensors).
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
            ),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        }
        parallelize_module(block, tp_mesh, block_plan)


def apply_context_parallel(model: Transformer, cp_mesh, layout: SequenceLayout, seq_len: int) -> None:
    """Ring attention over the cp group in every block, and RoPE positions of this rank's sequence shard."""
    core = RingAttentionCore(cp_mesh.get_group(), layout)
    for block in model.layers.values():
        block.attention.core = core
    model.register_forward_pre_hook(positions_hook(layout, cp_mesh.get_local_rank(), seq_len), with_kwargs=True)


def parallelize_llama3(model: Transformer, dims: ParallelDims, config: Config) -> Transformer:
    """Also applied to each pipeline stage (a Transformer with some layers, embedding or output removed)."""
    par = config.parallelism
    data_parallel = dims.fsdp_enabled or dims.dp_replicate > 1
    if config.float8.enable:
        # Linears are swapped before TP/FSDP shard them, so both see Float8Linear modules.
        convert_to_float8(model, config.float8, fsdp=data_parallel, tp=dims.tp)
    if dims.tp > 1:
        apply_tensor_parallel(model, dims.mesh("tp"), par.loss_parallel)
        if config.compile.async_tp:
            enable_async_tp()
    if dims.cp > 1:
        layout = context_layout(dims, par)
        apply_context_parallel(model, dims.mesh("cp"), layout, config.training.seq_len)
    # Activation checkpointing, then compile, wrap each block's forward; FSDP's hooks then go around both.
    apply_activation_checkpointing(model.layers, config.activation_checkpoint)
    if config.compile.enable:
        set_cache_dir(config.compile)
        # Ring attention's send/recv cannot be traced: under CP each block compiles around it.
        apply_compile(model.layers, config.activation_checkpoint, fullgraph=dims.cp == 1)
    if data_parallel:
        param_dtype = torch.bfloat16 if config.training.mixed_precision == "bf16" else torch.float32
        apply_fsdp(
            model,
            list(model.layers.values()),
            dims.mesh("fsdp"),
            param_dtype=param_dtype,
            reduce_dtype=DTYPES[par.fsdp_reduce_dtype],
            reshard_after_forward=par.fsdp_reshard_after_forward,
            cpu_offload=par.fsdp_cpu_offload,
        )
    return model
