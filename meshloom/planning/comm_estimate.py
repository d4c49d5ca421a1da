"""FLOPs and communication volume of one training step on one rank, from the shape model and the layout.

Volumes are bytes each rank sends per optimizer step, with ring algorithms: an all-gather or reduce-scatter
over n ranks sends (n - 1)/n of the full tensor, an all-reduce twice that.
"""

from __future__ import annotations

from meshloom.models.shape import ShapeModel
from meshloom.planning.layout import Layout, Precision
from meshloom.planning.memory_estimate import local_numel, pipeline_stages

COMM_DIMS = ("tp", "cp", "dp_shard", "dp_replicate", "pp", "ep")


def _ring(n: int) -> float:
    return (n - 1) / n if n > 1 else 0.0


def step_flops(shape: ShapeModel, layout: Layout, seq_len: int) -> tuple[float, float]:
    """(model FLOPs, executed FLOPs) per rank per step; executed adds full checkpointing's recomputed forward.

    Model FLOPs count active parameters only (top_k of each expert stack). Selective checkpointing keeps every
    matmul and attention output, so it recomputes no matmul FLOPs.
    """
    tokens = layout.microbatch_size * layout.microbatches * layout.dp * seq_len
    model = shape.flops_per_token(seq_len) * tokens / layout.world_size
    executed = model
    if layout.ac == "full":
        executed += shape.recompute_flops_per_token(seq_len) * tokens / layout.world_size
    return model, executed


def step_comm_bytes(shape: ShapeModel, layout: Layout, seq_len: int, precision: Precision = Precision()) -> dict[str, float]:
    """Bytes sent per rank per step, by mesh dimension, for the busiest pipeline stage."""
    a = precision.compute_bytes
    tokens = layout.microbatch_size * seq_len / layout.cp  # per microbatch on this rank
    hidden = tokens * shape.dim * a
    stage = max(pipeline_stages(shape, layout), key=lambda s: s.layers + s.first + s.last)
    blocks = [shape.block_params(layer) for layer in stage.block_ids]
    roots = shape.root_params(stage.first, stage.last)
    dense_elems = sum(local_numel([p for p in b if not p.expert], layout, fsdp=1) for b in blocks)
    dense_elems += local_numel(roots, layout, fsdp=1)
    expert_elems = sum(local_numel([p for p in b if p.expert], layout, fsdp=layout.ep) for b in blocks)
    m = layout.microbatches
    out = dict.fromkeys(COMM_DIMS, 0.0)

    # FSDP over dp_shard x cp (experts: over what ep leaves of it): gather weights for forward and again for
    # backward on every microbatch, reduce-scatter gradients once per step.
    per_elem = 2 * m * a + precision.reduce_dtype_bytes
    fsdp_volume = _ring(layout.fsdp) * dense_elems * per_elem + _ring(layout.expert_fsdp) * expert_elems * per_elem
    if layout.cp > 1:  # the shard group spans both dims; book it where most of its ranks are
        share = layout.cp / (layout.cp + layout.dp_shard)
        out["cp"] += fsdp_volume * share
        out["dp_shard"] += fsdp_volume * (1 - share)
    else:
        out["dp_shard"] += fsdp_volume
    # HSDP: all-reduce of the sharded gradients across replicas.
    sharded = dense_elems / layout.fsdp + expert_elems / layout.expert_fsdp
    out["dp_replicate"] += 2 * _ring(layout.dp_replicate) * sharded * precision.reduce_dtype_bytes
    # TP with sequence parallel: per block two all-gathers and two reduce-scatters of the hidden states forward,
    # the same backward, and again forward when a checkpointed block is recomputed.
    per_block = (12 if layout.ac == "full" else 8) * _ring(layout.tp) * hidden
    out["tp"] += m * (stage.layers * per_block + 4 * _ring(layout.tp) * hidden * (stage.first + stage.last))
    # CP ring attention: k and v pass around the ring forward; backward passes them and their gradients.
    for layer in stage.block_ids:
        kv = shape.cp_elements_per_token(layer) / layout.tp * tokens * a
        out["cp"] += m * 3 * (layout.cp - 1) * kv
    # EP: every routed token goes to top_k experts and comes back, forward and backward (dispatch + combine, and
    # their gradients), the share (ep - 1)/ep leaving this rank (uniform routing, which bias balancing aims at).
    # Each tensor-parallel rank dispatches the whole sequence. A checkpointed block (full or selective: the
    # exchange is never among the saved ops) dispatches and combines again when it is recomputed.
    exchanges = sum(
        4 + 2 * (mode in ("full", "selective_op"))
        for layer, mode in zip(stage.block_ids, layout.block_ac_modes(stage.block_ids))
        if shape.is_moe_block(layer)
    )
    out["ep"] += m * exchanges * _ring(layout.ep) * hidden * shape.top_k
    # PP: each microbatch's activations forward and their gradients backward cross a stage boundary.
    if layout.pp > 1:
        out["pp"] += m * 2 * hidden
    return out
