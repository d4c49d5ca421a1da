"""The one place where parallelism is applied to Qwen3, in a fixed order: Float8, TP/SP, CP, AC, compile, FSDP.

Tensor parallel follows Llama 3's plan, plus:

* QK-norm works per head, so each rank normalises its own heads; the norm weights are replicated and their
  gradients (partial: each rank saw only its heads) are summed over tp by DTensor;
* a sparse block's MoE layer gets the whole sequence (gathered from the sequence shards) and returns its output
  to the shards. The router and the routed experts are replicated over tp: every rank routes and computes every
  token, so their gradients are whole on each rank. Shared experts, when present, are split like a dense MLP.

Expert parallel (`parallelism.ep > 1`, meshloom/parallel/expert_parallel.py) splits each sparse block's routed
experts over the ep ranks (borrowed from dp_shard x cp) and FSDP-shards them over the rest; under tensor parallel
the routed experts are then not replicated over tp as DTensors: every tp rank dispatches the same whole-sequence
tokens to its ep group and computes them, as it does without expert parallel. Attention, dense MLPs, shared experts
and the router keep FSDP over dp_shard x cp, TP and CP as above.
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
from meshloom.models.qwen3.model import Qwen3, Qwen3Args
from meshloom.parallel.activation_checkpoint import apply_activation_checkpointing
from meshloom.parallel.compile import apply_compile, enable_async_tp, set_cache_dir
from meshloom.parallel.context import RingAttentionCore, SequenceLayout, positions_hook
from meshloom.parallel.document_balance import context_layout
from meshloom.parallel.dims import ParallelDims, check_divisible
from meshloom.parallel.expert_parallel import apply_expert_parallel
from meshloom.parallel.float8 import convert_to_float8
from meshloom.parallel.fsdp import apply_fsdp
from meshloom.parallel.moe_tensor import moe_block_plan

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def check_layout(args: Qwen3Args, dims: ParallelDims) -> None:
    """Every tensor-parallel rank gets whole heads, kv heads, vocabulary rows and MLP rows; every expert-parallel
    rank the same number of experts; no tied output across pipeline stages."""
    sizes = {"n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads, "vocab_size": args.vocab_size}
    if args.has_dense_layers:
        sizes["ffn_hidden_dim"] = args.ffn_hidden_dim
    if args.moe is not None and args.moe.shared_hidden_dim:
        sizes["shared_hidden_dim"] = args.moe.shared_hidden_dim
    check_divisible("tp", dims.tp, sizes)
    if dims.pp > 1 and args.tie_embeddings:
        raise ConfigError(
            "this model ties its output projection to the embedding, but pipeline parallelism puts them on different "
            "stages; use an untied model flavour or set parallelism.pp = 1"
        )
    if args.moe is not None:
        check_divisible("ep", dims.ep, {"n_experts": args.moe.n_experts})


def carve_stage(model: Qwen3, layers: Sequence[int], first: bool, last: bool) -> Qwen3:
    """Keep one stage's blocks (global indices), plus the embedding on the first and norm + output on the last."""
    keep = {str(i) for i in layers}
    for name in [name for name in model.layers if name not in keep]:
        del model.layers[name]
    if not first:
        model.tok_embeddings = None
    if not last:
        model.norm = None
        model.output = None
    return model


def apply_tensor_parallel(model: Qwen3, tp_mesh, loss_parallel: bool, replicate_experts: bool = True) -> None:
    """Megatron-style split of each block, activations between blocks sharded on the sequence. replicate_experts=False
    leaves the routed experts plain, for expert parallel to distribute over its own mesh."""
    root_plan = {}
    if model.tok_embeddings is not None:
        root_plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.norm is not None:
        root_plan["norm"] = SequenceParallel()
    if model.output is not None:
        root_plan["output"] = ColwiseParallel(
            input_layouts=Shard(1), output_layouts=Shard(-1) if loss_parallel else Replicate(), use_local_output=not loss_parallel
        )
    parallelize_module(model, tp_mesh, root_plan)
    if model.args.tie_embeddings and model.tok_embeddings is not None and model.output is not None:
        # Each style replaced its own weight; both are the same vocabulary-row shards, so tie them again.
        model.output.weight = model.tok_embeddings.weight

    for block in model.layers.values():
        plan = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            # [b, s, local heads, head_dim]: heads are dim 2.
            "attention.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
            "attention.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
        }
        if block.is_moe:
            plan.update(moe_block_plan(block.moe, replicate_experts))
        else:
            plan.update({
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            })  # fmt: skip
        parallelize_module(block, tp_mesh, plan)


def apply_context_parallel(model: Qwen3, cp_mesh, layout: SequenceLayout, seq_len: int) -> None:
    """Ring attention over the cp group in every block, and RoPE positions of this rank's sequence shard."""
    core = RingAttentionCore(cp_mesh.get_group(), layout)
    for block in model.layers.values():
        block.attention.core = core
    model.register_forward_pre_hook(positions_hook(layout, cp_mesh.get_local_rank(), seq_len), with_kwargs=True)


def _check_moe_settings(model: Qwen3, dims: ParallelDims, config: Config) -> None:
    if model.args.moe is None:
        return
    if dims.cp > 1 and config.moe.aux_loss_coef > 0:
        raise ConfigError(
            "moe.aux_loss_coef > 0 with parallelism.cp > 1: the sequence-wise balance loss needs whole sequences, "
            "which context parallel splits; set moe.aux_loss_coef = 0 or parallelism.cp = 1"
        )
    if config.checkpoint.hf_export_interval and config.moe.bias_update_rate > 0:
        raise ConfigError(
            "checkpoint.hf_export_interval with moe.bias_update_rate > 0: Hugging Face Qwen3-MoE has no place for the "
            "balancing bias, so the exports would route tokens differently; set moe.bias_update_rate = 0 (balance with "
            "moe.aux_loss_coef instead) or checkpoint.hf_export_interval = 0"
        )
    if config.compile.enable and config.moe.grouped_mm == "off":
        raise ConfigError(
            "moe.grouped_mm = 'off' loops over experts with data-dependent sizes, which compile.enable's fullgraph "
            "blocks cannot trace; set moe.grouped_mm to 'auto' or 'on', or compile.enable = false"
        )


def parallelize_qwen3(model: Qwen3, dims: ParallelDims, config: Config) -> Qwen3:
    """Also applied to each pipeline stage (a Qwen3 with some layers, embedding or output removed)."""
    _check_moe_settings(model, dims, config)
    par = config.parallelism
    data_parallel = dims.fsdp_enabled or dims.dp_replicate > 1
    if config.float8.enable:
        convert_to_float8(model, config.float8, fsdp=data_parallel, tp=dims.tp)
    if dims.tp > 1:
        apply_tensor_parallel(model, dims.mesh("tp"), par.loss_parallel, replicate_experts=dims.ep == 1)
        if config.compile.async_tp:
            enable_async_tp()
    if dims.cp > 1:
        apply_context_parallel(model, dims.mesh("cp"), context_layout(dims, par), config.training.seq_len)
    experts = None
    if dims.ep > 1:
        experts = apply_expert_parallel([block.moe for block in model.layers.values() if block.is_moe], dims)
    apply_activation_checkpointing(model.layers, config.activation_checkpoint)
    if config.compile.enable:
        set_cache_dir(config.compile)
        # Ring attention's send/recv and expert parallel's all-to-alls run between compiled graphs.
        apply_compile(model.layers, config.activation_checkpoint, fullgraph=dims.cp == 1 and dims.ep == 1)
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
            experts=experts,
        )
    return model
