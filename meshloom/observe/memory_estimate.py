"""Per-rank memory of a Llama 3 training layout, from shapes alone (no tensors, no process group).

What one rank holds, by kind:

- parameters: fp32 master weights, split by tensor parallel (matrices), pipeline stage (blocks, embedding,
  output) and FSDP (dim 0 of every local tensor, padded to a multiple of the shard degree);
- gradients: the same shapes in fp32 once reduced; while FSDP accumulates over microbatches without
  syncing, it keeps them unsharded instead;
- optimizer: AdamW's two fp32 moments per parameter;
- gathered: FSDP's unsharded copies in the compute dtype (two blocks in flight, plus the root's embedding
  and output, which stay gathered from forward to backward), or autocast's bf16 weight copies without FSDP;
- activations: the peak of what autograd keeps for backward, counted tensor by tensor from the model code
  (see `layer_activation_bytes_per_token`), for the activation-checkpointing mode and the microbatches
  a pipeline rank holds at once. Under checkpointing that peak is usually not the end of forward but the
  backward of the last block: its recomputed activations live next to the saved inputs of every block
  (see `recompute_peak_bytes_per_token`); without it, the end of forward, where the fp32 logits are alive
  until the loss is taken;
- transient: the logits' gradient at the start of backward.

The peak is parameters + optimizer + the larger of the activation phase (the activation peak, or the
forward-end activations plus the logits' gradient; gathered weights; gradients held over from earlier
microbatches) and the backward-end phase (gradients + gathered).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

FP32 = 4
ADAM_MOMENTS = 2
# Modes `meshloom plan` chooses from; the estimate also covers selective_layer (every k-th block in full).
AC_MODES = ("none", "selective_op", "full")
ESTIMATED_AC_MODES = AC_MODES + ("selective_layer",)
GIB = 2**30


@dataclass(frozen=True)
class Layout:
    """One way to run a model: parallel degrees, checkpointing mode and how a step is cut into microbatches.

    `microbatch_size` sequences go through each forward; each data-parallel rank runs `microbatches` of them
    per optimizer step (gradient accumulation, or the pipeline's microbatches when pp > 1).
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ac: str = "none"
    microbatch_size: int = 1
    microbatches: int = 1
    pipeline_schedule: str = "1F1B"
    # selective_layer: blocks k, 2k, 3k, ... (counting from 1 over the whole model) are checkpointed.
    every_k_layers: int = 1

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp * self.cp

    @property
    def fsdp(self) -> int:
        """Ranks that shard parameters: dp_shard x cp (context-parallel ranks also shard the weights)."""
        return self.dp_shard * self.cp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def describe(self) -> str:
        degrees = [f"{name}={getattr(self, name)}" for name in ("dp_replicate", "dp_shard", "tp", "pp", "cp")]
        ac = f"{self.ac}(k={self.every_k_layers})" if self.ac == "selective_layer" else self.ac
        return ",".join(degrees) + f" ac={ac} mbs={self.microbatch_size}x{self.microbatches}"

    def block_ac_modes(self, block_ids: range) -> list[str]:
        """The checkpointing mode of each block, by its index in the whole model (the rule of
        `meshloom.parallel.activation_checkpoint.checkpointed_block_ids`)."""
        if self.ac == "selective_layer":
            return ["full" if (i + 1) % self.every_k_layers == 0 else "none" for i in block_ids]
        return [self.ac] * len(block_ids)


@dataclass(frozen=True)
class Precision:
    """bf16 = FSDP's MixedPrecisionPolicy (or autocast without FSDP); fp32 everywhere otherwise."""

    mixed_precision: str = "fp32"
    reduce_dtype_bytes: int = FP32

    @property
    def compute_bytes(self) -> int:
        return 2 if self.mixed_precision == "bf16" else FP32


@dataclass
class MemoryEstimate:
    """Bytes on the busiest rank."""

    params: int
    grads: int
    optimizer: int
    gathered: int
    activations: int
    transient: int
    peak: int

    def gib(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) / GIB for f in fields(self)}


# ---------------------------------------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------------------------------------


def _split(size: int, parts: int) -> int:
    """The largest piece of `size` cut into `parts` by torch.chunk (what FSDP2 and DTensor do)."""
    return math.ceil(size / parts)


def block_param_shapes(args) -> list[tuple[tuple[int, ...], int | None]]:
    """(shape, tensor-parallel shard dim or None) of one block's parameters, following parallelize.py's plan."""
    d, hd = args.dim, args.head_dim
    q, kv, f = args.n_heads * hd, args.kv_heads * hd, args.ffn_hidden_dim
    return [
        ((d,), None),  # attention_norm (sequence parallel: replicated)
        ((q, d), 0),  # wq colwise
        ((kv, d), 0),  # wk
        ((kv, d), 0),  # wv
        ((d, q), 1),  # wo rowwise
        ((d,), None),  # ffn_norm
        ((f, d), 0),  # w1
        ((f, d), 0),  # w3
        ((d, f), 1),  # w2
    ]


def root_param_shapes(args, first: bool, last: bool) -> list[tuple[tuple[int, ...], int | None]]:
    """Embedding on the first stage, final norm and output on the last (the output shares the embedding
    when tied, and then lives where the embedding does)."""
    shapes = []
    if first:
        shapes.append(((args.vocab_size, args.dim), 0))
    if last:
        shapes.append(((args.dim,), None))
        if not args.tie_embeddings or not first:
            shapes.append(((args.vocab_size, args.dim), 0))
    return shapes


def local_numel(shapes: list[tuple[tuple[int, ...], int | None]], tp: int, fsdp: int) -> int:
    """Elements one rank stores: the TP shard, then FSDP's dim-0 chunk of it."""
    total = 0
    for shape, tp_dim in shapes:
        local = list(shape)
        if tp_dim is not None and tp > 1:
            local[tp_dim] = _split(local[tp_dim], tp)
        local[0] = _split(local[0], fsdp)
        total += math.prod(local)
    return total


def stage_layer_counts(n_layers: int, pp: int) -> list[int]:
    """Blocks per pipeline stage for an even split; leftovers go to the middle stages first, since the first
    and last stages also hold the embedding and the output (as meshloom.parallel.pipeline splits them)."""
    counts = [n_layers // pp] * pp
    order = list(range(1, pp - 1)) + [0, pp - 1] if pp > 1 else [0]
    for stage in order[: n_layers % pp]:
        counts[stage] += 1
    return counts


@dataclass(frozen=True)
class StageShape:
    """What one pipeline rank holds (the whole model when pp = 1)."""

    layers: int
    first: bool
    last: bool
    # Microbatches whose activations this rank holds at its peak.
    inflight: int
    # Index of the stage's first block in the whole model.
    first_layer: int = 0

    @property
    def block_ids(self) -> range:
        return range(self.first_layer, self.first_layer + self.layers)


def pipeline_stages(args, layout: Layout) -> list[StageShape]:
    counts = stage_layer_counts(args.n_layers, layout.pp)
    stages = []
    for stage, layers in enumerate(counts):
        if layout.pp == 1:
            inflight = 1  # gradient accumulation finishes each microbatch's backward before the next forward
        elif layout.pipeline_schedule == "GPipe":
            inflight = layout.microbatches  # all forwards, then all backwards
        else:
            # 1F1B family: stage s warms up with pp - s forwards before its first backward.
            inflight = min(layout.microbatches, layout.pp - stage)
        stages.append(StageShape(layers, stage == 0, stage == layout.pp - 1, inflight, sum(counts[:stage])))
    return stages


# ---------------------------------------------------------------------------------------------------------
# Activations
# ---------------------------------------------------------------------------------------------------------


def layer_activation_bytes_per_token(args, ac: str, tp: int, act_bytes: int) -> float:
    """Bytes one block keeps for backward per token of a microbatch, read off the model code.

    Terms (D = dim, Q = heads x head_dim, KV = kv heads x head_dim, F = ffn hidden, a = activation bytes;
    under TP the norms see 1/tp of the sequence and the matmuls 1/tp of the heads/hidden, while the
    inputs of wq/wk/wv and w1/w3 are the all-gathered, full-sequence norm outputs):
      each RMSNorm: its fp32 input copy (4D) and the normalised tensor before the weight (aD), plus its output,
      which the next linears keep (aD, gathered under TP);
      RoPE keeps nothing (cos/sin are buffers);
      attention: q, k and v after head repetition and the output (4aQ, the output is also wo's input) plus
      the fp32 log-sum-exp;
      SwiGLU: w1 and w3 outputs, silu output and the product (4aF).
    """
    d, hd = args.dim, args.head_dim
    q, kv, f, heads = args.n_heads * hd, args.kv_heads * hd, args.ffn_hidden_dim, args.n_heads
    a = act_bytes
    block_input = a * d / tp  # sequence-sharded under TP
    if ac == "full":
        return block_input
    if ac == "selective_op":
        # Kept: every matmul output and attention's outputs; norms, RoPE and SwiGLU are recomputed.
        # Under TP the row-parallel matmuls (wo, w2) produce full-size partial sums before the reduce-scatter,
        # which is itself kept.
        matmuls = a * (q + 2 * kv + 2 * f) / tp + 2 * a * d * (1 if tp == 1 else 1 + 1 / tp)
        attention = a * q / tp + FP32 * heads / tp
        return block_input + matmuls + attention
    assert ac == "none", ac
    norms = 2 * ((FP32 * d + a * d) / tp + a * d)
    attention = (4 * a * q + FP32 * heads) / tp
    ffn = 4 * a * f / tp
    return norms + attention + ffn


def recompute_peak_bytes_per_token(args, ac: str, tp: int, act_bytes: int) -> float:
    """Bytes per token that the backward of one checkpointed block adds to what its forward kept.

    Recomputation rebuilds everything that mode "none" keeps and `ac` does not (selective_op reuses the
    kept matmul outputs). The block input, kept by the checkpoint, is one of the tensors "none" counts only
    in fp32, where the attention norm's fp32 copy of its input is the input itself; in a narrower dtype
    the copy is a new tensor.
    """
    if ac == "none":
        return 0.0
    block_input = act_bytes * args.dim / tp
    shared_input = block_input if act_bytes == FP32 else 0.0
    none = layer_activation_bytes_per_token(args, "none", tp, act_bytes)
    kept = layer_activation_bytes_per_token(args, ac, tp, act_bytes)
    return none - (kept - block_input) - shared_input


def root_activation_bytes_per_token(
    args, stage: StageShape, tp: int, act_bytes: int, loss_parallel: bool, first: bool = True, last: bool = True
) -> float:
    """The embedding's indices on the first stage; the final norm and the fp32 log-softmax on the last
    (`first`/`last` = False leaves that end out)."""
    total = 0.0
    if stage.first and first:
        total += 8  # int64 token ids kept by the embedding's backward
    if stage.last and last:
        d, a = args.dim, act_bytes
        vocab = args.vocab_size / tp if (tp > 1 and loss_parallel) else args.vocab_size
        total += (FP32 * d + a * d) / tp + a * d + FP32 * vocab
    return total


# ---------------------------------------------------------------------------------------------------------
# The estimate
# ---------------------------------------------------------------------------------------------------------


def estimate_memory(
    args,
    layout: Layout,
    seq_len: int,
    precision: Precision = Precision(),
    loss_parallel: bool = True,
    with_optimizer: bool = True,
    stage_index: int | None = None,
) -> MemoryEstimate:
    """Per-rank memory of the busiest rank of `layout` training `args` on `seq_len`-token sequences
    (or of the ranks of pipeline stage `stage_index`)."""
    tokens = layout.microbatch_size * seq_len / layout.cp
    a = precision.compute_bytes
    fsdp = layout.fsdp
    sharded_data_parallel = fsdp > 1 or layout.dp_replicate > 1
    accumulate = layout.microbatches > 1
    block = block_param_shapes(args)
    block_gathered = local_numel(block, layout.tp, 1)

    best: MemoryEstimate | None = None
    stages = pipeline_stages(args, layout)
    for stage in stages if stage_index is None else [stages[stage_index]]:
        roots = root_param_shapes(args, stage.first, stage.last)
        param_elems = stage.layers * local_numel(block, layout.tp, fsdp) + local_numel(roots, layout.tp, fsdp)
        full_elems = stage.layers * block_gathered + local_numel(roots, layout.tp, 1)  # unsharded over FSDP
        params = FP32 * param_elems
        optimizer = ADAM_MOMENTS * FP32 * param_elems if with_optimizer else 0
        grads = FP32 * param_elems
        if layout.tp > 1 and not sharded_data_parallel and stage.first:
            # DTensor's embedding backward returns the table's gradient replicated, not vocabulary-sharded
            # (measured in torch 2.13); FSDP's reduce-scatter would shard it again.
            grads += FP32 * (args.vocab_size - _split(args.vocab_size, layout.tp)) * args.dim
        if sharded_data_parallel and fsdp > 1 and accumulate:
            # set_requires_gradient_sync(False) keeps unsharded gradients between microbatches.
            grads = precision.reduce_dtype_bytes * full_elems
        if sharded_data_parallel:
            # Two blocks in flight (current + prefetched) and the root's parameters kept for backward.
            gathered = a * (min(2, stage.layers) * block_gathered + local_numel(roots, layout.tp, 1))
        elif precision.mixed_precision == "bf16":
            gathered = 2 * full_elems  # autocast's bf16 weight copies, kept for backward
        else:
            gathered = 0
        vocab = args.vocab_size / layout.tp if (layout.tp > 1 and loss_parallel) else args.vocab_size
        logits = FP32 * vocab if stage.last else 0.0
        # The pipeline schedule keeps each microbatch's stage output (the fp32 logits on the last stage) until
        # that microbatch's backward is done.
        held_output = (logits or a * args.dim / layout.tp) if layout.pp > 1 else 0.0
        modes = layout.block_ac_modes(stage.block_ids)
        per_layer = [layer_activation_bytes_per_token(args, mode, layout.tp, a) for mode in modes]
        per_root = root_activation_bytes_per_token(args, stage, layout.tp, a, loss_parallel) + held_output
        saved = stage.inflight * tokens * (sum(per_layer) + per_root)
        # Backward of a checkpointed block j in one microbatch: that microbatch's loss-side activations and
        # the blocks after j are freed by then, j's recomputed activations live (largest for the last such j).
        others = (stage.inflight - 1) * tokens * (sum(per_layer) + per_root)
        first_side = root_activation_bytes_per_token(args, stage, layout.tp, a, loss_parallel, last=False) + held_output
        recompute_peak = 0.0
        for j, mode in enumerate(modes):
            if mode != "none":
                recompute = recompute_peak_bytes_per_token(args, mode, layout.tp, a)
                recompute_peak = max(recompute_peak, others + tokens * (sum(per_layer[: j + 1]) + first_side + recompute))
        # Without a pipeline, the fp32 logits live next to their log-softmax until the loss is taken.
        loss_logits = logits if layout.pp == 1 else 0.0
        activations = int(max(saved + tokens * loss_logits, recompute_peak))
        logits_grad = 2 * FP32 * vocab if stage.last else 0.0  # log-softmax's gradient and its input's
        transient = int(tokens * logits_grad)
        grads_during_forward = grads if (accumulate or layout.pp > 1) else 0
        forward_end = max(int(saved) + transient, activations) + gathered + grads_during_forward
        backward_end = grads + gathered
        peak = params + optimizer + max(forward_end, backward_end)
        estimate = MemoryEstimate(params, grads, optimizer, gathered, activations, transient, peak)
        if best is None or estimate.peak > best.peak:
            best = estimate
    assert best is not None
    return best
