"""FLOPs and communication volume of one training step on one rank, from the shape model and the layout.

Volumes are bytes each rank sends per optimizer step, with ring algorithms: an all-gather or reduce-scatter
over n ranks sends (n - 1)/n of the full tensor, an all-reduce twice that.
"""

from __future__ import annotations

import functools
from collections import Counter

from meshloom.models.shape import ParamShape, ShapeModel
from meshloom.planning.layout import FP32, Layout, Precision
from meshloom.planning.memory_estimate import FLOAT8, cached_block_params, is_moe_block, rank_root_params
from meshloom.planning.param_counts import local_numel
from meshloom.planning.pipeline_stages import StageShape, pipeline_stages

# Newton-Schulz iterations per Muon update (optimizer.muon_ns_steps' default) and the bytes of its dtype (bf16).
MUON_NS_STEPS = 5
MUON_NS_BYTES = 2

COMM_DIMS = ("tp", "cp", "dp_shard", "dp_replicate", "pp", "ep")


def _ring(n: int) -> float:
    return (n - 1) / n if n > 1 else 0.0


def step_flops(shape: ShapeModel, layout: Layout, seq_len: int) -> tuple[float, float]:
    """(model FLOPs, executed FLOPs) per rank per step; executed adds full checkpointing's recomputed forward.

    Model FLOPs count active parameters only (top_k of each expert stack). Selective checkpointing keeps every
    matmul and attention output, so it recomputes no matmul FLOPs.
    """
    tokens = layout.microbatch_size * layout.microbatches * layout.dp * seq_len
    per_token, recompute = _flops_per_token(shape, seq_len)
    model = per_token * tokens / layout.world_size
    executed = model
    if layout.ac == "full":
        executed += recompute * tokens / layout.world_size
    return model, executed


@functools.lru_cache(maxsize=64)
def _flops_per_token(shape: ShapeModel, seq_len: int) -> tuple[float, float]:
    """(training, full checkpointing's recomputation) FLOPs per token: fixed for a model, asked for per layout."""
    return shape.flops_per_token(seq_len), shape.recompute_flops_per_token(seq_len)


@functools.lru_cache(maxsize=4096)
def _block_parts(block: tuple[ParamShape, ...]) -> tuple[tuple[ParamShape, ...], ...]:
    """A block's dense matrices, dense vectors, expert stacks, and the matrices Muon updates."""
    return (
        tuple(p for p in block if not p.expert and len(p.shape) >= 2),
        tuple(p for p in block if not p.expert and len(p.shape) < 2),
        tuple(p for p in block if p.expert),
        tuple(p for p in block if len(p.shape) >= 2 and not p.adamw),
    )


def _distinct_stages(shape: ShapeModel, layout: Layout) -> list[StageShape]:
    """One pipeline rank of each kind (equal blocks, same ends): the others move the same bytes."""
    kinds = {}
    for stage in pipeline_stages(shape, layout):
        key = (tuple(id(cached_block_params(shape, layer)) for layer in stage.block_ids), stage.first, stage.last)
        kinds.setdefault(key, stage)
    return list(kinds.values())


def muon_flops(shape: ShapeModel, layout: Layout) -> float:
    """Newton-Schulz FLOPs per rank per optimizer step under Muon (0 under AdamW): each iteration on an m x n matrix
    (m <= n) is X X^T, a polynomial in it and its product with X, 4m^2 n + 2m^3 multiply-adds x 2. The matrices of
    one pipeline stage are shared out over its ranks (meshloom/train/orthogonalize.py balances them)."""
    if layout.optimizer != "Muon":
        return 0.0
    busiest = max(sum(_muon_block_flops(shape, layer) for layer in stage.block_ids) for stage in _distinct_stages(shape, layout))
    return busiest * layout.pp / layout.world_size


@functools.lru_cache(maxsize=4096)
def _muon_block_flops(shape: ShapeModel, layer: int) -> float:
    total = 0.0
    for p in cached_block_params(shape, layer):
        if len(p.shape) < 2 or p.adamw:
            continue
        count = p.shape[0] if len(p.shape) == 3 else 1
        m, n = sorted(p.shape[-2:])
        total += count * MUON_NS_STEPS * 2 * (4 * m * m * n + 2 * m**3)
    return total


def step_comm_bytes(shape: ShapeModel, layout: Layout, seq_len: int, precision: Precision = Precision()) -> dict[str, float]:
    """Bytes sent per rank per step, by mesh dimension: in each dimension, the most any pipeline rank sends."""
    per_stage = [_stage_comm_bytes(shape, layout, stage, seq_len, precision) for stage in _distinct_stages(shape, layout)]
    return {dim: max(volume[dim] for volume in per_stage) for dim in COMM_DIMS}


def _stage_comm_bytes(shape: ShapeModel, layout: Layout, stage: StageShape, seq_len: int, precision: Precision) -> dict[str, float]:
    a = precision.compute_bytes
    tokens = layout.microbatch_size * seq_len / layout.cp  # per microbatch on this rank
    hidden = tokens * shape.dim * a
    roots = rank_root_params(shape, stage)
    # Equal blocks are one object (cached_block_params): each kind is counted once, then multiplied.
    counts = Counter(id(cached_block_params(shape, layer)) for layer in stage.block_ids)
    kinds = {id(cached_block_params(shape, layer)): cached_block_params(shape, layer) for layer in stage.block_ids}
    matrices = vectors = expert_elems = muon = 0
    for key, block in kinds.items():
        parts = _block_parts(block)
        n = counts[key]
        matrices += n * local_numel(parts[0], layout, fsdp=1)
        vectors += n * local_numel(parts[1], layout, fsdp=1)
        expert_elems += n * local_numel(parts[2], layout, fsdp=layout.ep)
        if layout.optimizer == "Muon":
            muon += n * local_numel(parts[3], layout)
    root_elems = local_numel(roots, layout, fsdp=1)
    dense_elems = matrices + vectors + root_elems
    m = layout.microbatches
    out = dict.fromkeys(COMM_DIMS, 0.0)

    # FSDP over dp_shard x cp (experts: over what ep leaves of it): gather each unit's weights for forward and again
    # for backward on every microbatch, reduce-scatter gradients once per step. parallel/fsdp.py keeps two kinds of
    # unit gathered from forward to backward, so they are gathered once a microbatch: the root (embedding, norm,
    # output), and each stage's last block (its backward follows its forward at once); with reshard "never",
    # every unit. Float8 gathers the blocks' matrices in float8. (Under PP the schedule also keeps units gathered
    # between a microbatch's backward and the next forward; that saving is not modelled.)
    once = [_block_elems(shape, layout, blocks[-1]) for blocks in stage.stage_blocks if blocks] if layout.reshard_after_forward else []
    once_matrices, once_vectors, once_experts = (sum(part[i] for part in once) for i in range(3))
    f8 = FLOAT8 if layout.float8 else a
    gathers = 2 * m if layout.reshard_after_forward else m
    gather_bytes = gathers * (f8 * matrices + a * vectors) - m * (f8 * once_matrices + a * once_vectors) + m * a * root_elems
    dense_volume = gather_bytes + dense_elems * precision.reduce_dtype_bytes
    expert_volume = (gathers * expert_elems - m * once_experts) * a + expert_elems * precision.reduce_dtype_bytes
    fsdp_volume = _ring(layout.fsdp) * dense_volume + _ring(layout.expert_fsdp) * expert_volume
    # Muon: each rank sends its shard of every Muon matrix to the matrix's owner and gets its piece of the result back.
    fsdp_volume += 2 * _ring(layout.fsdp) * muon * MUON_NS_BYTES
    if layout.cp > 1 and layout.dp_shard > 1:  # the shard group spans both dims; book it where most of its ranks are
        share = layout.cp / (layout.cp + layout.dp_shard)
        out["cp"] += fsdp_volume * share
        out["dp_shard"] += fsdp_volume * (1 - share)
    else:
        out["cp" if layout.cp > 1 else "dp_shard"] += fsdp_volume
    # HSDP: all-reduce of the sharded gradients across replicas.
    sharded = dense_elems / layout.fsdp + expert_elems / layout.expert_fsdp
    out["dp_replicate"] += 2 * _ring(layout.dp_replicate) * sharded * precision.reduce_dtype_bytes
    # TP with sequence parallel: per block two all-gathers and two reduce-scatters of the hidden states forward,
    # the same backward, and again forward when a checkpointed block is recomputed; at each end of the model one
    # forward and one backward (the embedding's output reduce-scattered, the final norm's gathered for the output).
    per_block = (12 if layout.ac == "full" else 8) * _ring(layout.tp) * hidden
    out["tp"] += m * (stage.layers * per_block + 2 * _ring(layout.tp) * hidden * (stage.first + stage.last))
    # CP ring attention (parallel/context.py): each key/value shard makes cp - 1 hops forward and again backward,
    # in the compute dtype, and its gradient accumulator follows it cp hops home in float32.
    if layout.cp > 1:
        for layer in stage.block_ids:
            kv = shape.cp_elements_per_token(layer) / layout.tp * tokens
            out["cp"] += m * kv * (2 * (layout.cp - 1) * a + layout.cp * FP32)
    # EP: every routed token goes to top_k experts and comes back, forward and backward (dispatch + combine, and
    # their gradients), the share (ep - 1)/ep leaving this rank (uniform routing, which bias balancing aims at).
    # Each tensor-parallel rank dispatches the whole sequence. A checkpointed block (full or selective: the
    # exchange is never among the saved ops) dispatches and combines again when it is recomputed.
    exchanges = sum(
        4 + 2 * (mode in ("full", "selective_op"))
        for layer, mode in zip(stage.block_ids, layout.block_ac_modes(stage.block_ids))
        if is_moe_block(shape, layer)
    )
    out["ep"] += m * exchanges * _ring(layout.ep) * hidden * shape.top_k
    # PP: each of this rank's stages sends a microbatch's activations to the next stage and their gradients to the
    # previous one, unless that stage is on this rank too (the turn of a V schedule) or there is none.
    if layout.pp > 1:
        n_stages = len(layout.stage_layer_counts) or layout.pp * layout.stages_per_rank
        held = set(stage.stages)
        sends = sum((s + 1 < n_stages and s + 1 not in held) + (s > 0 and s - 1 not in held) for s in stage.stages)
        out["pp"] += m * sends * hidden
    return out


def _block_elems(shape: ShapeModel, layout: Layout, layer: int) -> tuple[int, int, int]:
    """One block's gathered (dense matrices, dense vectors, expert stacks) elements on one rank."""
    matrices, vectors, experts, _ = _block_parts(cached_block_params(shape, layer))
    return local_numel(matrices, layout, fsdp=1), local_numel(vectors, layout, fsdp=1), local_numel(experts, layout, fsdp=layout.ep)
