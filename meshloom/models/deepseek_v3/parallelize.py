"""Where parallelism is applied to DeepSeek-V3, in a fixed order: Float8, TP/SP, CP, EP, AC, compile, FSDP.

Also what the degrees require of the shapes (`check_layout`) and how a pipeline stage is cut (`carve_stage`).

Tensor parallel for MLA. Heads are split: the up-projections (wq or wq_b, wkv_b) are column-parallel and wo is
row-parallel with a sequence-sharded output, as in every family. The low-rank down-projections run on each rank's
sequence shard with replicated weights, so no rank repeats another's work: the q latent (q_lora_rank per token)
is gathered by wq_b, the kv latent with the shared rotary key (kv_lora_rank + qk_rope_head_dim per token) is
gathered once as wkv_a's output, and kv_norm then runs on the whole latent with replicated weights. Every local
head reads the one rotary key, so its gradient is a partial sum per rank: `shared_rope_key` all-reduces it.
Multi-token prediction modules get the blocks' plan; their norms and projection work on the sequence shard.

Tensor parallel for the mixture-of-experts blocks (as Qwen3's): the MoE layer gets the whole sequence, gathered from
the shards, and returns its output to them. The router and the routed experts are replicated over tp, so every rank
routes and computes every token and their gradients are whole on each rank (the balancing counts too, so they are
summed over data-parallel ranks only); the shared experts are split like a dense MLP.

Expert parallel (`parallelism.ep > 1`, meshloom/parallel/expert_parallel.py) splits the routed experts of every MoE
layer `moe_layers` returns (the main blocks' and the prediction modules') over the ep ranks, borrowed from
dp_shard x cp, and FSDP-shards them over the rest. Under tensor parallel they are then left plain rather than
replicated over tp: every tp rank dispatches the same whole sequence to its ep group, as it computes it without
expert parallel. MLA, the router, the shared experts and the dense MLPs keep TP, CP and FSDP as above.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_module,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from meshloom.config.errors import ConfigError
from meshloom.config.schema import Config
from meshloom.models.common.moe import MoE
from meshloom.models.deepseek_v3.args import DeepSeekV3Args
from meshloom.models.deepseek_v3.model import DeepSeekBlock, DeepSeekV3
from meshloom.parallel.activation_checkpoint import apply_activation_checkpointing
from meshloom.parallel.compile import apply_compile, enable_async_tp, set_cache_dir
from meshloom.parallel.context import RingAttentionCore, SequenceLayout, positions_hook
from meshloom.parallel.document_balance import context_layout
from meshloom.parallel.dims import ParallelDims, check_divisible
from meshloom.parallel.expert_parallel import apply_expert_parallel
from meshloom.parallel.float8 import convert_to_float8
from meshloom.parallel.fsdp import apply_fsdp
from meshloom.parallel.moe_tensor import moe_block_plan
from meshloom.parallel.sequence_shift import ShardedSequenceShift

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def check_layout(args: DeepSeekV3Args, dims: ParallelDims) -> None:
    """Every tensor-parallel rank gets whole heads, vocabulary rows and MLP rows (dense and shared experts); the
    routed experts split evenly over ep (that ep divides dp_shard x cp is ParallelDims' check)."""
    sizes = {"n_heads": args.n_heads, "vocab_size": args.vocab_size}
    if args.n_dense_layers:
        sizes["inter_dim"] = args.inter_dim
    if args.has_moe and args.n_shared_experts:
        sizes["moe_inter_dim x n_shared_experts"] = args.moe_inter_dim * args.n_shared_experts
    check_divisible("tp", dims.tp, sizes)
    if args.has_moe:
        check_divisible("ep", dims.ep, {"n_routed_experts": args.n_routed_experts})


def check_moe_settings(args: DeepSeekV3Args, dims: ParallelDims, config: Config) -> None:
    """[moe] and export settings this model and layout cannot honour (run before anything is materialised)."""
    if not args.has_moe:
        return
    if dims.cp > 1 and config.moe.aux_loss_coef > 0:
        raise ConfigError(
            "moe.aux_loss_coef > 0 with parallelism.cp > 1: the sequence-wise balance loss needs whole sequences, "
            "which context parallel splits; set moe.aux_loss_coef = 0 or parallelism.cp = 1"
        )
    if config.compile.enable and config.moe.grouped_mm == "off":
        raise ConfigError(
            "moe.grouped_mm = 'off' loops over experts with data-dependent sizes, which compile.enable's fullgraph "
            "blocks cannot trace; set moe.grouped_mm to 'auto' or 'on', or compile.enable = false"
        )
    if config.checkpoint.hf_export_interval and args.score_func != "sigmoid":
        raise ConfigError(
            f"checkpoint.hf_export_interval with a {args.score_func}-routed model: Hugging Face DeepseekV3ForCausalLM "
            "always routes by sigmoid scores; set checkpoint.hf_export_interval = 0 or use a sigmoid-routed flavour"
        )


def check_context_parallel(args: DeepSeekV3Args, layout: SequenceLayout, seq_len: int) -> None:
    """Multi-token prediction reads labels up to mtp_depth places past a chunk's end, from the next chunk only."""
    chunk = seq_len // layout.num_chunks
    if args.mtp_depth > chunk:
        raise ConfigError(
            f"multi-token prediction looks {args.mtp_depth} tokens ahead, but context parallel cuts training.seq_len="
            f"{seq_len} into chunks of {chunk}; use sequences of at least {args.mtp_depth * layout.num_chunks} tokens "
            "or a smaller parallelism.cp"
        )


def carve_stage(model: DeepSeekV3, layers: Sequence[int], first: bool, last: bool) -> DeepSeekV3:
    """Keep one stage's blocks, the embedding on the first stage, and the final norm, output and prediction modules on
    the last; a last stage with prediction modules also keeps a copy of the embedding (their input)."""
    keep = {str(i) for i in layers}
    for name in [name for name in model.layers if name not in keep]:
        del model.layers[name]
    if not first and not (last and model.mtp is not None):
        model.tok_embeddings = None
    if not last:
        model.norm = None
        model.output = None
        model.mtp = None
    return model


class ReplicateParallel(ParallelStyle):
    """Parameters replicated over tp for a module whose local input is the same on every rank; local output."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def to_replicated(mod, inputs, mesh):
            return tuple(DTensor.from_local(t, mesh, [Replicate()], run_check=False) for t in inputs)

        return distribute_module(module, device_mesh, input_fn=to_replicated, output_fn=lambda mod, out, mesh: out.to_local())


class SumGradOverRanks(ParallelStyle):
    """An identity whose input every rank uses for its own heads: forward unchanged, backward the gradient summed
    over the tp ranks (what each rank's heads contributed)."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def mark(mod, inputs, mesh):
            return tuple(
                DTensor.from_local(t, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()]) for t in inputs
            )

        return distribute_module(module, device_mesh, input_fn=mark)


def _block_plan(block: DeepSeekBlock, replicate_experts: bool) -> dict[str, ParallelStyle]:
    attention = block.attention
    plan: dict[str, ParallelStyle] = {"attention_norm": SequenceParallel()}
    if attention.wq is not None:
        plan["attention.wq"] = ColwiseParallel(input_layouts=Shard(1))
    else:
        plan["attention.wq_a"] = SequenceParallel()
        plan["attention.q_norm"] = SequenceParallel()
        plan["attention.wq_b"] = ColwiseParallel(input_layouts=Shard(1))
    plan.update({
        "attention.wkv_a": SequenceParallel(),
        "attention.kv_norm": ReplicateParallel(),
        "attention.wkv_b": ColwiseParallel(),
        "attention.shared_rope_key": SumGradOverRanks(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
    })  # fmt: skip
    if hasattr(block, "feed_forward"):
        plan.update({
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })  # fmt: skip
        return plan
    plan.update(moe_block_plan(block.moe, replicate_experts))
    return plan


def apply_tensor_parallel(model: DeepSeekV3, tp_mesh, loss_parallel: bool, replicate_experts: bool = True) -> None:
    """replicate_experts=False leaves the routed experts plain, for expert parallel to distribute on its own mesh."""
    root_plan: dict[str, ParallelStyle] = {}
    if model.tok_embeddings is not None:
        root_plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.norm is not None:
        root_plan["norm"] = SequenceParallel()
    if model.output is not None:
        root_plan["output"] = ColwiseParallel(
            input_layouts=Shard(1), output_layouts=Shard(-1) if loss_parallel else Replicate(), use_local_output=not loss_parallel
        )
    for name in model.mtp or {}:
        root_plan.update({
            f"mtp.{name}.embed_norm": SequenceParallel(),
            f"mtp.{name}.hidden_norm": SequenceParallel(),
            f"mtp.{name}.proj": SequenceParallel(use_local_output=True),
            f"mtp.{name}.norm": SequenceParallel(),
        })  # fmt: skip
    parallelize_module(model, tp_mesh, root_plan)
    for block in _blocks(model).values():
        parallelize_module(block, tp_mesh, _block_plan(block, replicate_experts))
        # The latent leaves wkv_a sequence-sharded and is gathered whole for kv_norm, wkv_b and the rotary key.
        parallelize_module(
            block.attention.wkv_a, tp_mesh,
            PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=True),
        )  # fmt: skip


def _blocks(model: DeepSeekV3) -> nn.ModuleDict:
    """Every transformer block of this (stage of the) model, prediction modules' included, keyed by block index
    (a prediction module's block counts on from n_layers), as activation checkpointing and compile take them."""
    blocks = dict(model.layers.items())
    for name, module in (model.mtp or {}).items():
        blocks[str(model.args.n_layers + int(name))] = module.block
    return nn.ModuleDict(blocks)


def moe_layers(model: DeepSeekV3) -> dict[str, MoE]:
    """This (stage of the) model's mixture-of-experts layers, prediction modules' included, by block index."""
    return {index: block.moe for index, block in _blocks(model).items() if isinstance(getattr(block, "moe", None), MoE)}


def apply_context_parallel(model: DeepSeekV3, cp_mesh, layout: SequenceLayout, seq_len: int) -> None:
    """Ring attention in every block, this rank's RoPE positions, and label shifts that cross shards."""
    check_context_parallel(model.args, layout, seq_len)
    core = RingAttentionCore(cp_mesh.get_group(), layout)
    for block in _blocks(model).values():
        block.attention.core = core
    model.sequence_shift = ShardedSequenceShift(cp_mesh.get_group(), layout)
    model.register_forward_pre_hook(positions_hook(layout, cp_mesh.get_local_rank(), seq_len), with_kwargs=True)


def parallelize_deepseek_v3(model: DeepSeekV3, dims: ParallelDims, config: Config) -> DeepSeekV3:
    """Also applied to each pipeline stage (a model with some blocks, the embedding or the output removed)."""
    check_moe_settings(model.args, dims, config)
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
    experts = apply_expert_parallel(list(moe_layers(model).values()), dims) if dims.ep > 1 else None
    blocks = _blocks(model)
    apply_activation_checkpointing(blocks, config.activation_checkpoint)
    if config.compile.enable:
        set_cache_dir(config.compile)
        # Ring attention's send/recv and expert parallel's all-to-alls run between compiled graphs.
        apply_compile(blocks, config.activation_checkpoint, fullgraph=dims.cp == 1 and dims.ep == 1)
    if data_parallel:
        param_dtype = torch.bfloat16 if config.training.mixed_precision == "bf16" else torch.float32
        apply_fsdp(
            model,
            [*model.layers.values(), *(model.mtp or {}).values()],
            dims.mesh("fsdp"),
            param_dtype=param_dtype,
            reduce_dtype=DTYPES[par.fsdp_reduce_dtype],
            reshard_after_forward=par.fsdp_reshard_after_forward,
            cpu_offload=par.fsdp_cpu_offload,
            experts=experts,
        )
    return model
