"""FLOPs and communication volume of one training step on one rank, from the model shape and the layout.

Volumes are bytes each rank sends per optimizer step, with ring algorithms: an all-gather or reduce-scatter
over n ranks sends (n - 1)/n of the full tensor, an all-reduce twice that.
"""

from __future__ import annotations

from meshloom.observe.memory_estimate import (
    Layout,
    Precision,
    block_param_shapes,
    local_numel,
    pipeline_stages,
    root_param_shapes,
)
from meshloom.observe.metrics import flops_per_token

COMM_DIMS = ("tp", "cp", "dp_shard", "dp_replicate", "pp")


def _ring(n: int) -> float:
    return (n - 1) / n if n > 1 else 0.0


def step_flops(args, layout: Layout, seq_len: int) -> tuple[float, float]:
    """(model FLOPs, executed FLOPs) per rank per step; executed adds full checkpointing's recomputed forward.

    Selective checkpointing keeps every matmul and attention output, so it recomputes no matmul FLOPs.
    """
    embedding = args.vocab_size * args.dim
    total_params = args.n_layers * local_numel(block_param_shapes(args), 1, 1) + embedding + args.dim
    total_params += 0 if args.tie_embeddings else embedding
    no_embedding = total_params - (0 if args.tie_embeddings else embedding)
    per_token = flops_per_token(no_embedding, args.n_layers, args.n_heads, args.head_dim, seq_len)
    tokens = layout.microbatch_size * layout.microbatches * layout.dp * seq_len
    model = per_token * tokens / layout.world_size
    executed = model
    if layout.ac == "full":
        block_params = args.n_layers * local_numel(block_param_shapes(args), 1, 1)
        recompute = 2.0 * block_params + 4.0 * args.n_layers * args.n_heads * args.head_dim * seq_len
        executed += recompute * tokens / layout.world_size
    return model, executed


def step_comm_bytes(args, layout: Layout, seq_len: int, precision: Precision = Precision()) -> dict[str, float]:
    """Bytes sent per rank per step, by mesh dimension, for the busiest pipeline stage."""
    a = precision.compute_bytes
    tokens = layout.microbatch_size * seq_len / layout.cp  # per microbatch on this rank
    hidden = tokens * args.dim * a
    stage = max(pipeline_stages(args, layout), key=lambda s: s.layers + s.first + s.last)
    block = block_param_shapes(args)
    stage_elems = stage.layers * local_numel(block, layout.tp, 1)
    stage_elems += local_numel(root_param_shapes(args, stage.first, stage.last), layout.tp, 1)
    m = layout.microbatches
    out = dict.fromkeys(COMM_DIMS, 0.0)

    # FSDP over dp_shard x cp: gather weights for forward and again for backward on every microbatch,
    # reduce-scatter gradients once per step.
    fsdp_volume = _ring(layout.fsdp) * stage_elems * (2 * m * a + precision.reduce_dtype_bytes)
    if layout.cp > 1:  # the shard group spans both dims; book it where most of its ranks are
        share = layout.cp / (layout.cp + layout.dp_shard)
        out["cp"] += fsdp_volume * share
        out["dp_shard"] += fsdp_volume * (1 - share)
    else:
        out["dp_shard"] += fsdp_volume
    # HSDP: all-reduce of the sharded gradients across replicas.
    out["dp_replicate"] += 2 * _ring(layout.dp_replicate) * stage_elems / layout.fsdp * precision.reduce_dtype_bytes
    # TP with sequence parallel: per block two all-gathers and two reduce-scatters of the hidden states forward,
    # the same backward, and again forward when a checkpointed block is recomputed.
    per_block = (12 if layout.ac == "full" else 8) * _ring(layout.tp) * hidden
    out["tp"] += m * (stage.layers * per_block + 4 * _ring(layout.tp) * hidden * (stage.first + stage.last))
    # CP ring attention: k and v pass around the ring forward; backward passes them and their gradients.
    kv = 2 * args.kv_heads * args.head_dim / layout.tp * tokens * a
    out["cp"] += m * stage.layers * 3 * (layout.cp - 1) * kv
    # PP: each microbatch's activations forward and their gradients backward cross a stage boundary.
    if layout.pp > 1:
        out["pp"] += m * 2 * hidden
    return out
