"""Per-rank memory of a training layout of any model family, from its shape model alone (no tensors, no process group).

What one rank holds, by kind:

- parameters: fp32 master weights, split by tensor parallel (matrices), pipeline stage (blocks, embedding,
  output) and FSDP (dim 0 of every local tensor, padded to a multiple of the shard degree); routed experts
  are split over ep first and FSDP-sharded over what dp_shard x cp leaves;
- gradients: the same shapes in fp32 once reduced; while FSDP accumulates over microbatches without
  syncing, it keeps them unsharded instead (but for routed experts a framework keeps out of FSDP, whose gradients are
  autograd's own, `Precision.fsdp_wraps_whole_experts`);
- optimizer: AdamW's two fp32 moments per parameter; under Muon one fp32 momentum buffer per element of the matrices
  Muon updates (every matrix the shape model does not mark `adamw`), two moments for the rest. Newton-Schulz's
  transient copies of whole matrices on their owner ranks (in optimizer.muon_ns_dtype) are not counted;
- gathered: FSDP's unsharded copies in the compute dtype (two blocks in flight, plus the root's embedding
  and output, which stay gathered from forward to backward), or autocast's bf16 weight copies without FSDP; under
  compile or Float8, the copies of the blocks' weights the traced block keeps (`meshloom.planning.traced_terms`);
- activations: the peak of what autograd keeps for backward, counted tensor by tensor from the model code
  (the family's `ShapeModel.block_activation_bytes_per_token`), for the activation-checkpointing mode and the microbatches
  a pipeline rank holds at once; under compile, Float8 or autocast over fp32 weights, what torch itself says a block
  keeps (`meshloom.planning.traced_terms`: AOTAutograd's partitioner, autograd's saved tensors). Under
  checkpointing that peak is usually not the end of forward but the backward of the last block: its recomputed activations live next to the saved inputs of every block
  (see `ShapeModel.block_recompute_bytes_per_token`); without it, the end of forward, where the fp32 logits are alive
  until the loss is taken (with a third vocabulary-wide tensor under loss parallel), or, on a pipeline stage
  without the loss, inside its last block when that block's short-lived tensors (a MoE block's routed token
  copies, `ShapeModel.block_transient_bytes_per_token`) outgrow what follows it. On CPU, attention without a fused
  kernel (MLA's) also keeps its softmax probabilities (`ShapeModel.with_math_attention`), and eager FlexAttention
  (gpt-oss's) holds score-sized temporaries in a block's backward (`block_attention_backward_bytes_per_token`);
- transient: the logits' gradient at the start of backward (under loss parallel, the fused backward's three
  vocabulary-wide temporaries); with the chunked loss, one chunk and the gradients it sums (loss_memory.py).

The peak is parameters + optimizer + the largest of the activation phase (the activation peak, or the
forward-end activations plus the logits' gradient; gathered weights; gradients held over from earlier
microbatches), the backward phases (gradients + gathered, and moments inside a block's backward) and the optimizer
step (gradients, plus on CPU the foreach AdamW's temporary copy of its parameters)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from meshloom.config.errors import UserError
from meshloom.models.shape import ParamShape, ShapeModel
from meshloom.planning.layout import FP32, Layout, Precision
from meshloom.planning.loss_memory import chunked_loss_bytes, whole_logits_bytes
from meshloom.planning.param_counts import in_fsdp, largest_chunk, local_numel
from meshloom.planning.block_cache import (
    _attention_backward, _block_activation, _mixer_recompute, _recompute_peak, _with_context_parallel,
    _with_math_attention, cached_block_params, cached_mlp_params, cached_root_params, describes_mlp, is_moe_block,
    rank_root_params,
)  # fmt: skip
from meshloom.planning.pipeline_stages import ALL_FORWARDS_FIRST, StageShape, pipeline_stages
from meshloom.planning import traced_terms
from meshloom.planning.allocator import reserved_bytes

ADAM_MOMENTS = 2
MUON_MOMENTS = 1
OPTIMIZERS = ("AdamW", "Muon")
FLOAT8 = 1
GIB = 2**30


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
    # The pipeline rank these bytes are for (the busiest one unless a rank was asked for).
    stage: int = 0
    # What the caching allocator reserves for that peak on a GPU (meshloom.planning.allocator); the peak on CPU.
    reserved: int = 0

    def gib(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) / GIB for f in fields(self) if f.name != "stage"}


# ---------------------------------------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------------------------------------


def optimizer_state_numel(shapes: list[ParamShape], layout: Layout, optimizer: str) -> int:
    """Elements of optimizer state one rank keeps for `shapes` (0-d step counters left out)."""
    if optimizer not in OPTIMIZERS:
        raise UserError(f"no memory model for optimizer {optimizer!r}; estimates cover {', '.join(OPTIMIZERS)}")
    if optimizer == "AdamW":
        return ADAM_MOMENTS * local_numel(shapes, layout)
    muon = [p for p in shapes if len(p.shape) >= 2 and not p.adamw]
    adamw = [p for p in shapes if len(p.shape) < 2 or p.adamw]
    return MUON_MOMENTS * local_numel(muon, layout) + ADAM_MOMENTS * local_numel(adamw, layout)


# ---------------------------------------------------------------------------------------------------------
# Activations
# ---------------------------------------------------------------------------------------------------------


def root_activation_bytes_per_token(
    shape: ShapeModel, stage: StageShape, tp: int, act_bytes: int, loss_parallel: bool, first: bool = True, last: bool = True,
    ac: str = "none", ep: int = 1, loss_bytes: int = FP32,
) -> float:  # fmt: skip
    """The embedding's indices on the first stage; the final norm and the log-softmax (in `loss_bytes`) on the last,
    and whatever else the family keeps there (`first`/`last` = False leaves that end out)."""
    total = 0.0
    if stage.first and first:
        total += 8  # int64 token ids kept by the embedding's backward
    if stage.last and last:
        d, a = shape.dim, act_bytes
        vocab = shape.vocab_size / tp if (tp > 1 and loss_parallel) else shape.vocab_size
        total += (FP32 * d + a * d) / tp + a * d + loss_bytes * vocab
        total += shape.last_stage_extra_activation_bytes_per_token(ac, tp, act_bytes, loss_parallel, ep)
    return total


# ---------------------------------------------------------------------------------------------------------
# The estimate
# ---------------------------------------------------------------------------------------------------------


def gathered_in_backward(units: list[int], position: int, stage: StageShape, block_bytes: int, roots_bytes: int) -> int:
    """FSDP's gathered weights inside the backward of a rank's block at `position` (`units`: each block's unsharded
    elements): the block's own, the block before it gathered ahead (prefetched) except before the first block of a
    model part, and the root's (`roots_bytes`)."""
    part_start = stage.block_ids[position] in {ids[0] for ids in stage.stage_blocks if ids}
    prefetched = units[position - 1] if position and not part_start else 0
    return block_bytes * (units[position] + prefetched) + roots_bytes


def estimate_memory(
    shape: ShapeModel,
    layout: Layout,
    seq_len: int,
    precision: Precision = Precision(),
    loss_parallel: bool = True,
    with_optimizer: bool = True,
    stage_index: int | None = None,
    optimizer: str | None = None,
) -> MemoryEstimate:
    """Per-rank memory of the busiest rank of `layout` training the model `shape` describes on `seq_len`-token
    sequences (or of the ranks of pipeline rank `stage_index`) with `optimizer` (optimizer.name; default the
    layout's)."""
    optimizer = optimizer or layout.optimizer
    if precision.device == "cpu" and layout.cp == 1:
        # Context parallel's ring attention is meshloom's own (it keeps no probabilities) on every device.
        shape = _with_math_attention(shape, seq_len)
    if layout.cp > 1:
        shape = _with_context_parallel(shape, layout.cp, seq_len)
    tokens = layout.microbatch_size * seq_len / layout.cp
    a = precision.compute_bytes
    fsdp = layout.fsdp
    sharded_data_parallel = fsdp > 1 or layout.dp_replicate > 1
    accumulate = layout.microbatches > 1
    # Compile, Float8 and autocast over fp32 weights: terms asked of torch (meshloom.planning.traced_terms).
    setting = traced_terms.traced_setting(layout, precision, seq_len)
    # Routed experts FSDP leaves whole stay out of it where the framework says so (Precision.fsdp_wraps_whole_experts):
    # never gathered, their gradients autograd's own.
    experts_out = not precision.fsdp_wraps_whole_experts and layout.ep > 1 and max(1, fsdp // layout.ep) == 1

    best: MemoryEstimate | None = None
    stages = pipeline_stages(shape, layout)
    if stage_index is None:
        # Of ranks holding equal blocks and ends, the one with the most microbatches in flight needs the most.
        kinds_of = {}
        for stage in stages:
            key = (tuple(id(cached_block_params(shape, layer)) for layer in stage.block_ids), stage.first, stage.last)
            if key not in kinds_of or stage.inflight > kinds_of[key].inflight:
                kinds_of[key] = stage
        stages = list(kinds_of.values())
    else:
        stages = [stages[stage_index]]
    for stage in stages:
        blocks = [cached_block_params(shape, layer) for layer in stage.block_ids]
        # Equal blocks are one object (see cached_block_params): each kind is counted once, then multiplied.
        kinds = {id(block): block for block in blocks}
        sharded = {i: local_numel(block, layout) for i, block in kinds.items()}
        whole = {i: local_numel(in_fsdp(block, experts_out), layout, fsdp=1) for i, block in kinds.items()}
        state = {i: optimizer_state_numel(block, layout, optimizer) for i, block in kinds.items()}
        roots = rank_root_params(shape, stage)
        param_elems = sum(sharded[id(block)] for block in blocks) + local_numel(roots, layout)
        gathered_blocks = sorted((whole[id(block)] for block in blocks), reverse=True)
        full_elems = sum(gathered_blocks) + local_numel(roots, layout, fsdp=1)  # unsharded over FSDP
        outside_elems = sum(local_numel([p for p in block if p.expert], layout) for block in blocks) if experts_out else 0
        master = precision.master_bytes
        params = master * param_elems
        state_elems = sum(state[id(block)] for block in blocks) + optimizer_state_numel(roots, layout, optimizer)
        optimizer_bytes = master * state_elems if with_optimizer else 0
        grads = master * param_elems
        if layout.tp > 1 and not sharded_data_parallel and stage.first and not shape.tie_embeddings:
            # DTensor's embedding backward returns the table's gradient replicated, not vocabulary-sharded
            # (measured in torch 2.13); FSDP's reduce-scatter would shard it again. A table tied to the output
            # projection receives the projection's sharded gradient first, and the embedding's is added into it.
            grads += master * (shape.vocab_size - largest_chunk(shape.vocab_size, layout.tp)) * shape.dim
        if sharded_data_parallel and fsdp > 1 and accumulate:
            # set_requires_gradient_sync(False) keeps unsharded gradients between microbatches.
            grads = precision.reduce_dtype_bytes * full_elems + master * outside_elems
        if sharded_data_parallel:
            # Two blocks in flight (current + prefetched) and the root's parameters kept for backward; every block
            # when they stay gathered from forward to backward. Float8 gathers the blocks' matrices in float8.
            # torchao all-gathers in float8 under tensorwise scaling only (its rowwise recipe casts after the gather).
            float8_gather = layout.float8 and layout.float8_recipe == "tensorwise" and layout.float8_all_gather
            block_bytes = FLOAT8 if float8_gather else a
            in_flight = gathered_blocks if not layout.reshard_after_forward else gathered_blocks[:2]
            gathered = block_bytes * sum(in_flight) + a * local_numel(roots, layout, fsdp=1)
        elif precision.mixed_precision == "bf16":
            gathered = 2 * full_elems  # autocast's bf16 weight copies, kept for backward
        else:
            gathered = 0
        # Copies of the blocks' weights a compiled graph or Float8Linear keeps for backward, per microbatch in flight
        # (traced; a gathered float8 weight is FSDP's own buffer): they replace autocast's without FSDP.
        modes = layout.block_ac_modes(stage.block_ids)
        copies = [traced_terms.block_weight_copies(shape, layer, mode, setting) for layer, mode in zip(stage.block_ids, modes)]
        if copies and None not in copies:
            # The traced block is unsharded: its weights' casts are split over tensor parallel like the weights.
            kept = stage.inflight * sum(copies) / layout.tp
            if not sharded_data_parallel:
                gathered = int((2 if setting.kind == "autocast" else 0) * local_numel(roots, layout) + kept)
            elif not float8_gather:
                gathered += int(kept)
        vocab = shape.vocab_size / layout.tp if (layout.tp > 1 and loss_parallel) else shape.vocab_size
        logits = whole_logits_bytes(precision, layout) * vocab if stage.last else 0.0
        # The pipeline schedule keeps each microbatch's stage output (the logits, in the loss's dtype, on the last
        # stage) until that microbatch's backward is done.
        held_output = (logits or a * shape.dim / layout.tp) if layout.pp > 1 else 0.0
        if setting.traced:
            per_layer = [traced_terms.block_bytes_per_token(shape, layer, mode, layout.tp, a, setting)
                         for layer, mode in zip(stage.block_ids, modes)]  # fmt: skip
        else:
            per_layer = [_block_activation(shape, layer, mode, layout.tp, a) for layer, mode in zip(stage.block_ids, modes)]
        per_root = root_activation_bytes_per_token(
            shape, stage, layout.tp, a, loss_parallel, ac=layout.ac, ep=layout.ep, loss_bytes=whole_logits_bytes(precision, layout)
        ) + held_output
        # The compiled loss keeps what the partitioner chose (traced) instead of the eager log-softmax.
        # (The chunked loss is no compiled loss: its head computes the loss itself, a chunk at a time.)
        compiled = stage.last and not layout.loss_chunk_tokens
        compiled_loss = traced_terms.compiled_loss(shape, layout, loss_parallel, setting, precision) if compiled else None
        if compiled_loss is not None:
            per_root += compiled_loss.saved_per_token - precision.loss_bytes * vocab
            per_root += precision.loss_bytes * vocab if compiled_loss.keeps_logits else 0.0
        first_root = root_activation_bytes_per_token(shape, stage, layout.tp, a, loss_parallel, last=False)
        # The loss side (the final norm, the logits and what the family keeps there) is held for one microbatch at
        # the rank's peak under every schedule that runs a microbatch's backward on the last stage right after its
        # forward, i.e. all but GPipe and LoopedBFS: 1F1B's last rank holds one microbatch anyway; an interleaved
        # schedule's last rank peaks at the end of warm-up, whose last forward is the first microbatch's through the
        # last stage (torch's Interleaved1F1B: (v - 1)pp warm-up forwards there, in rounds of pp microbatches per
        # stage); the V schedules' rank 0 reaches the last stage at the V's turn. The rank's other stages hold their
        # outputs per microbatch.
        loss_side = 0.0
        if stage.last and layout.pp > 1 and layout.pipeline_schedule not in ALL_FORWARDS_FIRST:
            loss_side = per_root - first_root  # the last stage's root and its held logits
            per_root = first_root + (a * shape.dim / layout.tp if len(stage.stages) > 1 else 0.0)
        saved = stage.inflight * tokens * (sum(per_layer) + per_root) + tokens * loss_side
        # Backward of a checkpointed block j in one microbatch: that microbatch's loss-side activations and
        # the blocks after j are freed by then, j's recomputed activations live (largest for the last such j).
        others = (stage.inflight - 1) * tokens * (sum(per_layer) + per_root)
        first_side = first_root + held_output
        recompute_peak, kept_so_far = 0.0, 0.0
        for layer, mode, kept in zip(stage.block_ids, modes, per_layer):
            kept_so_far += kept
            if mode != "none":
                recompute = _recompute_peak(shape, layer, mode, layout.tp, a, layout.ep)
                if setting.compile:
                    recompute = traced_terms.compiled_recompute_bytes_per_token(shape, layer, layout.tp, a, setting)
                recompute_peak = max(recompute_peak, others + tokens * (kept_so_far + first_side + recompute))
            else:
                # The block's own short-lived tensors in its first forward: they outgrow what the rest of the
                # forward adds when little follows the block (the last block of a stage without the loss).
                transient = shape.block_transient_bytes_per_token(layer, layout.tp, layout.ep, a)
                if transient:
                    recompute_peak = max(recompute_peak, others + tokens * (kept_so_far + first_root + transient))
        # Without a pipeline, the fp32 logits live next to their log-softmax until the loss is taken.
        loss_logits = logits if layout.pp == 1 else 0.0
        # Loss parallel's log-softmax over vocabulary shards (DTensor's) keeps the max-shifted logits next to its
        # input and its result until it returns: a third vocabulary-wide tensor while the loss is taken (the fused
        # one-device kernel makes none).
        loss_shift = logits if (layout.tp > 1 and loss_parallel) else 0.0
        # A training-only head's block recomputed in backward (DeepSeek-V3's prediction modules): the loss's logits
        # and log-softmaxes are freed by then, everything else the stage keeps is alive.
        if stage.last:
            head = shape.last_stage_recompute_bytes_per_token(layout.ac, layout.tp, a, loss_parallel, layout.ep)
            recompute_peak = max(recompute_peak, saved + tokens * head)
        activations = int(max(saved + tokens * (loss_logits + loss_shift), recompute_peak))
        # The log-softmax's gradient and its input's. Loss parallel's backward is one fused step for the loss and the
        # log-softmax (torch's `_nll_loss_and_log_softmax_backward`, torch.distributed.tensor.parallel.loss): it zeroes
        # a vocabulary-wide gradient, adds exp of the saved log-probabilities to it and multiplies the sum by the
        # loss's gradient, so three vocabulary-wide tensors (in the loss's dtype) are alive next to the saved one, not two.
        logits_grad = (3 if loss_shift else 2) * whole_logits_bytes(precision, layout) * vocab if stage.last else 0.0
        if compiled_loss is not None:
            logits_grad = compiled_loss.vocab_wide_grads * precision.loss_bytes * vocab
        transient = int(tokens * logits_grad) + chunked_loss_bytes(shape, layout, stage.last, tokens, a)
        # Gradients exist during a forward only once an earlier microbatch's backward ran (accumulation, or a pipeline
        # schedule's later microbatches); zero_grad frees them at the end of each step.
        grads_during_forward = grads if layout.microbatches > 1 else 0
        forward_end = max(int(saved) + transient, activations) + gathered + grads_during_forward
        backward_end = grads + gathered
        if layout.pp > 1:
            # A pipeline stage's backward runs while its activations are alive and the gradients of the blocks already
            # done accumulate (bounded by the activation peak next to every gradient; measured on the PP 2 cells).
            backward_end = max(backward_end, activations + grads + gathered)
        # Inside the backward of a block whose attention runs an eager path over the whole score matrix (FlexAttention
        # on CPU; `ShapeModel.block_attention_backward_bytes_per_token`): the blocks before it keep theirs, the block
        # its attention's tensors and the backward's score-sized temporaries; the later blocks' gradients exist (reduced
        # under FSDP), the loss side's and the block's own too (unsharded; its attention's, not made yet, counted).
        # Largest at the last block without checkpointing, at the first with it (benchmarks/RESULTS.md, whole peak).
        units = [whole[id(block)] for block in blocks]
        roots_gathered = a * local_numel(roots, layout, fsdp=1)
        kept_before, unsharded = 0.0, (a if fsdp > 1 else master)
        for position, (layer, mode, kept) in enumerate(zip(stage.block_ids, modes, per_layer)):
            attention_side = _attention_backward(shape, layer, mode, layout.tp, a)
            if attention_side:
                later = sum(sharded[id(block)] for block in blocks[position + 1 :])
                loss_side_params = cached_root_params(shape, False, True) if stage.last else ()
                own = local_numel(blocks[position] + loss_side_params, layout, fsdp=1)
                done = grads if accumulate else master * later + unsharded * own
                held = others + tokens * (kept_before + first_side + attention_side)
                in_flight = gathered
                if fsdp > 1 and layout.reshard_after_forward:
                    in_flight = gathered_in_backward(units, position, stage, block_bytes, roots_gathered)
                backward_end = max(backward_end, int(held) + done + in_flight)
            kept_before += kept
        if fsdp > 1 and gathered_blocks:
            # FSDP's backward of its largest unit: autograd's unsharded gradient of the unit (in the gathered dtype) and
            # the reduce-scatter's input buffer it is copied into (in the reduce dtype) are alive at once, next to the
            # gathered weights and the unit's reduced shard. What else is alive was read off the tracker when the last
            # block's gradients are reduced (the first unit to be; the whole-peak table of benchmarks/RESULTS.md): what
            # the blocks before it keep and, when that block is dense and checkpointed, most of its recomputation (the
            # recomputation peak stands for it); a MoE block's recomputed tensors are gone by then.
            unit = gathered_blocks[0]
            alive = stage.inflight * tokens * (sum(per_layer[:-1]) + first_root)
            last = stage.block_ids[-1] if stage.block_ids else None
            if last is not None and modes[-1] != "none" and not is_moe_block(shape, last):
                alive = max(alive, recompute_peak)
            unit_backward = (a + precision.reduce_dtype_bytes) * unit + master * largest_chunk(unit, fsdp) + int(alive) + gathered
            backward_end = max(backward_end, unit_backward + (grads if accumulate else 0))
            # Inside the backward of any checkpointed block (not only the last): once its MLP's backward is done, the
            # MLP's unsharded gradients (a MoE block's experts, most of its unit) are alive next to the token mixer's
            # recomputed tensors, the reduce-scatter buffer of the block after it (freed at the next reduce-scatter),
            # the reduced shards of every later block and what the blocks before it keep (read off the tracker on
            # Qwen3-Next's FSDP 2 cells, benchmarks/RESULTS.md; families without `block_mlp_params` add nothing).
            # The block before it is gathered ahead (`gathered_in_backward`).
            if describes_mlp(shape):
                reduced_after = [0] * (len(units) + 1)  # the reduced shards of the blocks after each position
                for position in reversed(range(len(units))):
                    reduced_after[position] = reduced_after[position + 1] + largest_chunk(units[position], fsdp)
                kept_so_far = 0.0
                for position, (layer, mode, kept) in enumerate(zip(stage.block_ids, modes, per_layer)):
                    kept_so_far += kept
                    mlp = local_numel(in_fsdp(cached_mlp_params(shape, layer), experts_out), layout, fsdp=1)
                    if mode == "none" or not mlp:
                        continue
                    next_unit = units[position + 1] if position + 1 < len(units) else 0
                    in_block = gathered_in_backward(units, position, stage, block_bytes, roots_gathered)
                    mixer = _mixer_recompute(shape, layer, mode, layout.tp, a)
                    held = stage.inflight * tokens * (kept_so_far + first_root) + tokens * mixer
                    mid_block = (
                        a * mlp + precision.reduce_dtype_bytes * next_unit + master * reduced_after[position + 1]
                        + int(held) + (in_block if layout.reshard_after_forward else gathered)
                    )  # fmt: skip
                    backward_end = max(backward_end, mid_block + (grads if accumulate else 0))
        # The optimizer step: on CPU meshloom runs AdamW's foreach implementation, whose square roots of the second
        # moments are one more fp32 copy of every AdamW-updated parameter, alive next to the gradients (measured by
        # the whole-peak table, benchmarks/RESULTS.md); on CUDA the fused kernels make none.
        adamw_elems = state_elems - param_elems  # AdamW keeps 2 per element, Muon 1
        step_phase = grads + (FP32 * adamw_elems if with_optimizer and precision.device == "cpu" else 0)
        peak = params + optimizer_bytes + max(forward_end, backward_end, step_phase)
        reserved = reserved_bytes(peak, precision.device)
        estimate = MemoryEstimate(params, grads, optimizer_bytes, gathered, activations, transient, peak, stage.rank, reserved)
        if best is None or estimate.peak > best.peak:
            best = estimate
    assert best is not None
    return best
