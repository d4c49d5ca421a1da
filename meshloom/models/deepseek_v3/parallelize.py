"""DeepSeek-V3's parallel parts: what its shapes require of the degrees and settings, its blocks' tensor-parallel
plans, its MoE layers and prediction modules, and what its last pipeline stage keeps. The order in which parallelism
is applied lives once, in meshloom/parallel/apply.py.

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

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from meshloom.config.schema import Config
from meshloom.models.common.moe import MoE
from meshloom.models.common.tensor_plans import dense_mlp_plan
from meshloom.models.deepseek_v3.args import DeepSeekV3Args
from meshloom.models.deepseek_v3.model import DeepSeekBlock, DeepSeekV3
from meshloom.parallel.apply import BlockPlan, ParallelParts
from meshloom.parallel.context import SequenceLayout
from meshloom.parallel.dims import ParallelDims, check_divisible
from meshloom.parallel.moe_tensor import moe_block_plan
from meshloom.parallel.sequence_shift import ShardedSequenceShift


def check_layout(args: DeepSeekV3Args, config: Config, dims: ParallelDims) -> None:
    """Every tensor-parallel rank gets whole heads, vocabulary rows and MLP rows (dense and shared experts). Multi-token
    prediction under context parallel and exports of softmax routing are pairs of the declaration
    (meshloom/planning/features.py)."""
    sizes = {"n_heads": args.n_heads, "vocab_size": args.vocab_size}
    if args.n_dense_layers:
        sizes["inter_dim"] = args.inter_dim
    if args.has_moe and args.n_shared_experts:
        sizes["moe_inter_dim x n_shared_experts"] = args.moe_inter_dim * args.n_shared_experts
    check_divisible("tp", dims.tp, sizes)


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
    plan.update(dense_mlp_plan() if hasattr(block, "feed_forward") else moe_block_plan(block.moe, replicate_experts))
    return plan


def block_tp_plan(block: DeepSeekBlock, replicate_experts: bool) -> BlockPlan:
    # The latent leaves wkv_a sequence-sharded and is then gathered whole for kv_norm, wkv_b and the rotary key.
    gather_latent = PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=True)
    return [_block_plan(block, replicate_experts), {"attention.wkv_a": gather_latent}]


def mtp_tp_plan(model: DeepSeekV3) -> dict[str, ParallelStyle]:
    """The prediction modules' norms and projection work on the sequence shard (their blocks get the block plan)."""
    plan: dict[str, ParallelStyle] = {}
    for name in model.mtp or {}:
        plan.update({
            f"mtp.{name}.embed_norm": SequenceParallel(),
            f"mtp.{name}.hidden_norm": SequenceParallel(),
            f"mtp.{name}.proj": SequenceParallel(use_local_output=True),
            f"mtp.{name}.norm": SequenceParallel(),
        })  # fmt: skip
    return plan


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


def install_sequence_shift(model: DeepSeekV3, cp_group: dist.ProcessGroup, layout: SequenceLayout) -> None:
    """Multi-token prediction's label shifts cross shard boundaries under context parallel."""
    model.sequence_shift = ShardedSequenceShift(cp_group, layout)


PARALLEL = ParallelParts(
    block_tp_plan=block_tp_plan,
    embedding="tok_embeddings",
    final_norm="norm",
    output="output",
    blocks=_blocks,
    root_tp_plan=mtp_tp_plan,
    moe_layers=lambda model: list(moe_layers(model).values()),
    extra_fsdp_units=lambda model: list((model.mtp or {}).values()),
    on_context_parallel=install_sequence_shift,
    last_stage_only=("mtp",),
    embedding_on_last_stage=lambda model: model.mtp is not None,
)
