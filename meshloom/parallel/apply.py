"""The one driver that applies parallelism to a model (or to one pipeline stage of it), in a fixed order:

kernel choices -> Float8 -> tensor/sequence parallel -> context parallel -> expert parallel -> activation checkpointing -> compile -> FSDP.

Float8 swaps the linear layers first, so TP and FSDP both see Float8Linear modules. TP then places the root (embedding,
final norm, output head) and each block by the family's plan. CP swaps every attention's core for ring attention (a linear-attention layer's for state passing); EP
swaps each MoE layer's experts for the all-to-all dispatch. Activation checkpointing and compile wrap each block's
``forward`` (parameter names do not change), and FSDP's hooks go around both, block by block, then the root.

The driver imports nothing from ``meshloom.models``: a family hands it a `ParallelParts` (plain names and callables,
held by its ModelSpec), so the order lives here once and a dense family brings only its block TP plan.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel, parallelize_module

from meshloom.parallel.activation_checkpoint import apply_activation_checkpointing
from meshloom.parallel.compile import apply_compile, enable_async_tp, set_cache_dir
from meshloom.parallel.context import RingAttentionCore, SequenceLayout, positions_hook
from meshloom.parallel.document_balance import context_layout
from meshloom.parallel.expert_parallel import apply_expert_parallel
from meshloom.parallel.float8 import convert_to_float8
from meshloom.parallel.fsdp import apply_fsdp
from meshloom.parallel.state_passing import StatePassingCore

if TYPE_CHECKING:
    import torch.distributed as dist

    from meshloom.planning.kernels import KernelPlan
    from meshloom.planning.run_plan import RunPlan

# A block's tensor-parallel plan: applied to the block in order (a later plan may wrap a module an earlier one placed).
BlockPlan = Sequence[Mapping[str, ParallelStyle]]


def _default_blocks(model: nn.Module) -> Mapping[str, nn.Module]:
    return model.layers


@dataclass(frozen=True)
class ParallelParts:
    """What a model family tells the driver about its modules: its block TP plan and root module names, and where it
    differs from a dense decoder, its MoE layers and extra modules."""

    # (block, replicate_experts) -> the block's TP plan. replicate_experts is False under expert parallel, which then
    # places the routed experts on its own mesh (see parallel/moe_tensor.py).
    block_tp_plan: Callable[[nn.Module, bool], BlockPlan]
    # Attribute names of the root modules: the embedding (first stage), the final norm and output head (last stage);
    # a pipeline stage without one holds None there.
    embedding: str
    final_norm: str
    output: str
    # The model's (or stage's) transformer blocks by global block index: what TP, CP, AC, compile and FSDP wrap.
    blocks: Callable[[nn.Module], Mapping[str, nn.Module]] = _default_blocks
    # A block's attention module, whose `core` (the attention kernel) context parallel swaps for ring attention.
    attention: Callable[[nn.Module], nn.Module] = lambda block: block.attention
    # Whether a block's `attention` is a linear-attention layer (a recurrent state instead of keys and values), whose
    # `core` context parallel swaps for state passing (parallel/state_passing.py) instead of the ring.
    passes_state: Callable[[nn.Module], bool] = lambda block: False
    # Extra root TP entries beyond embedding / norm / output (e.g. multi-token prediction modules' norms).
    root_tp_plan: Callable[[nn.Module], Mapping[str, ParallelStyle]] = lambda model: {}
    # The mixture-of-experts layers whose routed experts expert parallel distributes; empty for a dense family.
    moe_layers: Callable[[nn.Module], Sequence[nn.Module]] = lambda model: []
    # Root-level FSDP units besides the blocks (e.g. prediction modules, which hold blocks of their own).
    extra_fsdp_units: Callable[[nn.Module], Sequence[nn.Module]] = lambda model: []
    # Called once context parallel is installed: (model, cp process group, layout), e.g. to shift labels across shards.
    on_context_parallel: Callable[[nn.Module, dist.ProcessGroup, SequenceLayout], None] | None = None
    # Root modules besides the final norm and output head that only the last pipeline stage keeps.
    last_stage_only: tuple[str, ...] = ()
    # Whether the last pipeline stage also keeps (a copy of) the embedding, e.g. for prediction modules that read it.
    embedding_on_last_stage: Callable[[nn.Module], bool] = lambda model: False


def carve_stage(model: nn.Module, parts: ParallelParts, layers: Sequence[int], first: bool, last: bool) -> nn.Module:
    """Cut a (meta-device) model down to one pipeline stage: its blocks (names keep their global index), the embedding
    on the first stage, and the final norm, output head and the family's `last_stage_only` modules on the last."""
    keep = {str(i) for i in layers}
    for name in [name for name in model.layers if name not in keep]:
        del model.layers[name]
    if not first and not (last and parts.embedding_on_last_stage(model)):
        setattr(model, parts.embedding, None)
    if not last:
        for name in (parts.final_norm, parts.output, *parts.last_stage_only):
            setattr(model, name, None)
    return model


def _present(model: nn.Module, name: str) -> bool:
    return getattr(model, name, None) is not None


def apply_tensor_parallel(model: nn.Module, parts: ParallelParts, tp_mesh, loss_parallel: bool, replicate_experts: bool) -> None:
    """Megatron-style split: the embedding's vocabulary rows, then each block by the family's plan, with the activations
    between blocks sharded on the sequence; the output head leaves logits vocabulary-sharded under loss parallel."""
    embedding = getattr(model, parts.embedding, None)
    output = getattr(model, parts.output, None)
    tied = embedding is not None and output is not None and output.weight is embedding.weight
    root: dict[str, ParallelStyle] = {}
    if embedding is not None:
        # Vocabulary rows are split; the output leaves sequence-sharded for the first norm.
        root[parts.embedding] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if _present(model, parts.final_norm):
        root[parts.final_norm] = SequenceParallel()
    if output is not None:
        root[parts.output] = ColwiseParallel(
            input_layouts=Shard(1), output_layouts=Shard(-1) if loss_parallel else Replicate(), use_local_output=not loss_parallel
        )
    root.update(parts.root_tp_plan(model))
    parallelize_module(model, tp_mesh, root)
    if tied:
        # Each style replaced its own weight; both are the same vocabulary-row shards, so tie them again.
        getattr(model, parts.output).weight = getattr(model, parts.embedding).weight
    for block in parts.blocks(model).values():
        for plan in parts.block_tp_plan(block, replicate_experts):
            parallelize_module(block, tp_mesh, dict(plan))


def apply_kernel_plan(model: nn.Module, parts: ParallelParts, kernels: KernelPlan) -> None:
    """Hand the modules the run's kernel choices as plain values, so that no forward asks the device: the routed
    experts' grouped matmul and cast, and each attention core's kernel (a core with `configured` takes the plan's
    values it uses)."""
    for layer in parts.moe_layers(model):
        layer.experts.grouped_mm, layer.experts.compute_dtype = kernels.grouped_mm, kernels.expert_dtype
    for block in parts.blocks(model).values():
        attention = parts.attention(block)
        if hasattr(attention.core, "configured"):
            attention.core = attention.core.configured(fla_ops=kernels.fla_ops, eager_operator=kernels.flex_eager_operator)


def apply_context_parallel(
    model: nn.Module, parts: ParallelParts, cp_mesh, layout: SequenceLayout, seq_len: int, kernels: KernelPlan
) -> None:
    """Ring attention over the cp group in every softmax-attention block, state passing in every linear-attention
    block (both on the one token layout), and the RoPE positions of this rank's sequence shard."""
    ring = RingAttentionCore(cp_mesh.get_group(), layout)
    state_passing = StatePassingCore(cp_mesh.get_group(), layout, fla=kernels.fla_ops)
    for block in parts.blocks(model).values():
        parts.attention(block).core = state_passing if parts.passes_state(block) else ring
    if parts.on_context_parallel is not None:
        parts.on_context_parallel(model, cp_mesh.get_group(), layout)
    model.register_forward_pre_hook(positions_hook(layout, cp_mesh.get_local_rank(), seq_len), with_kwargs=True)


def parallelize(model: nn.Module, plan: RunPlan) -> nn.Module:
    """Apply every parallelism the plan asks for, in the fixed order; on one process Float8, AC and compile still apply.
    Also applied to each pipeline stage (a model with some blocks, the embedding or the output removed)."""
    parts, dims, config = plan.spec.parallel, plan.dims, plan.config
    data_parallel = dims.fsdp_enabled or dims.dp_replicate > 1
    apply_kernel_plan(model, parts, plan.kernels)
    if config.float8.enable:
        convert_to_float8(model, config.float8, fsdp=data_parallel, tp=dims.tp)
    if dims.tp > 1:
        apply_tensor_parallel(model, parts, dims.mesh("tp"), plan.loss_parallel, replicate_experts=dims.ep == 1)
        if config.compile.async_tp:
            enable_async_tp()
    if dims.cp > 1:
        apply_context_parallel(model, parts, dims.mesh("cp"), context_layout(dims, config.parallelism), config.training.seq_len,
                               plan.kernels)
    experts = apply_expert_parallel(list(parts.moe_layers(model)), dims) if dims.ep > 1 else None
    blocks = nn.ModuleDict(dict(parts.blocks(model)))
    apply_activation_checkpointing(blocks, config.activation_checkpoint)
    if config.compile.enable:
        set_cache_dir(config.compile)
        # Ring attention's send/recv and expert parallel's all-to-alls run eagerly between compiled graphs.
        apply_compile(blocks, config.activation_checkpoint, fullgraph=dims.cp == 1 and dims.ep == 1)
    if data_parallel:
        apply_fsdp(
            model,
            [*model.layers.values(), *parts.extra_fsdp_units(model)],
            dims.mesh("fsdp"),
            param_dtype=plan.param_dtype,
            reduce_dtype=plan.reduce_dtype,
            reshard_after_forward=plan.fsdp_reshard_after_forward,
            cpu_offload=config.parallelism.fsdp_cpu_offload,
            experts=experts,
        )
    return model
