"""The memory estimate's terms that torch itself is asked for (meshloom.planning.traced_block): what a compiled block
saves (AOTAutograd's partitioner), what a compiled loss saves, what Float8Linear saves, and what autocast without FSDP
adds to the hand-counted eager block. Each is traced once per block kind and cached; a layout with none of compile,
Float8 or autocast over fp32 weights traces nothing and gets exactly the shape model's figures.

Where a trace cannot follow the layout, the traced block is the unsharded one and the layout's share of it is taken in
proportion to the shape model's: under tensor parallel (tp > 1), the compiled block keeps the share of its traced
bytes that the shape model's block keeps at that degree, and a shape model's wrapper (torchtitan's op policy in
benchmarks/published_runs.py, the CPU's math attention, context parallel) changes the compiled block by what it
changes the eager one.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from meshloom.models.shape import FP32, ShapeModel
from meshloom.planning.layout import Layout, Precision
from meshloom.planning.traced_block import SavedBytes, compiled_block_saved, compiled_loss_saved, compute_kind, eager_block_saved

BF16 = 2


@dataclass(frozen=True)
class TracedSetting:
    """What the traces depend on, for one layout and precision."""

    kind: str  # traced_block.COMPUTE_KINDS
    float8: str | None  # the Float8 recipe, or None
    compile: bool
    tokens: int  # tokens of one sequence on a rank (seq_len / cp): the traced batch of one

    @property
    def traced(self) -> bool:
        """Whether any term differs from the shape model's: compile, Float8, or autocast over fp32 weights."""
        return self.compile or self.float8 is not None or self.kind == "autocast"


def traced_setting(layout: Layout, precision: Precision, seq_len: int) -> TracedSetting:
    sharded = layout.fsdp > 1 or layout.dp_replicate > 1
    kind = compute_kind(precision.mixed_precision, sharded)
    return TracedSetting(kind, layout.float8_recipe if layout.float8 else None, layout.compile, seq_len // layout.cp)


@functools.lru_cache(maxsize=4096)
def _plain(shape: ShapeModel) -> ShapeModel:
    """The family's own shape model of the same arguments, without any wrapper's changes."""
    from meshloom.planning.traced_block import _spec_of

    return _spec_of(shape.args).shape_model(shape.args)


@functools.lru_cache(maxsize=65536)
def _first_of_kind(shape: ShapeModel, layer: int) -> int:
    """The first block with the same parameters as `layer`: equal blocks are traced once."""
    params = shape.block_params(layer)
    return next(i for i in range(shape.n_layers) if shape.block_params(i) == params)


def _wrapper_change(shape: ShapeModel, layer: int, mode: str, tp: int, a: int) -> float:
    return shape.block_activation_bytes_per_token(layer, mode, tp, a) - _plain(shape).block_activation_bytes_per_token(
        layer, mode, tp, a
    )


def _tp_share(shape: ShapeModel, layer: int, mode: str, tp: int, a: int) -> float:
    plain = _plain(shape)
    return plain.block_activation_bytes_per_token(layer, mode, tp, a) / plain.block_activation_bytes_per_token(layer, mode, 1, a)


def _compiled(shape: ShapeModel, layer: int, mode: str, setting: TracedSetting) -> SavedBytes | None:
    """The partitioner's count, or None for a block it cannot trace (counted as eager by the callers)."""
    layer = _first_of_kind(shape, layer)
    return compiled_block_saved(shape.args, layer, mode, setting.kind, setting.float8, setting.tokens)


def block_bytes_per_token(shape: ShapeModel, layer: int, mode: str, tp: int, a: int, setting: TracedSetting) -> float:
    """What block `layer` keeps for backward per token under checkpointing mode `mode`.

    Compiled: the partitioner's saved tensors. Eager: the shape model's count (for the blocks' compute dtype under FSDP)
    plus what the trace of the run's own setting adds to the trace of that reference: autocast's fp32 residual stream
    (the embedding's fp32 output carried through every residual add, each norm's fp32 normalised tensor, each linear's
    own bf16 cast of its input) and Float8Linear's saved input (torchao float8_linear.py's
    matmul_with_hp_or_float8_args saves its high-precision input and weight and casts again in backward).
    Under checkpointing a block keeps its input only (what autocast's fp32 stream widens); the trace sees the
    checkpoint's own hooks, not the tensors behind them, so it is taken for mode none.
    """
    counted = shape.block_activation_bytes_per_token(layer, mode, tp, a)
    if not setting.traced:
        return counted
    if setting.compile and (compiled := _compiled(shape, layer, mode, setting)) is not None:
        return compiled.per_token * _tp_share(shape, layer, mode, tp, a) + _wrapper_change(shape, layer, mode, tp, a)
    reference = "bf16" if setting.kind in ("bf16", "autocast") else "fp32"
    if mode != "none":
        widened = (FP32 - BF16) * shape.dim / tp if setting.kind == "autocast" else 0.0
        return counted + widened
    first = _first_of_kind(shape, layer)
    own = eager_block_saved(shape.args, first, "none", setting.kind, setting.float8).per_token
    ref = eager_block_saved(shape.args, first, "none", reference, None).per_token
    return counted + (own - ref) / tp


def compiled_recompute_bytes_per_token(shape: ShapeModel, layer: int, tp: int, a: int, setting: TracedSetting) -> float:
    """Inside a checkpointed compiled block's backward: at most what the block keeps without checkpointing, recomputed
    next to what it saved (the partitioner's graph for mode none)."""
    compiled = _compiled(shape, layer, "none", setting)
    if compiled is None:
        return shape.block_activation_bytes_per_token(layer, "none", tp, a)
    return compiled.per_token * _tp_share(shape, layer, "none", tp, a) + _wrapper_change(shape, layer, "none", tp, a)


def block_weight_copies(shape: ShapeModel, layer: int, mode: str, setting: TracedSetting) -> int | None:
    """Bytes of copies of block `layer`'s weights kept for backward under checkpointing mode `mode` (a compiled graph's
    bf16 or float8 casts, which the partitioner may instead recompute in backward; Float8Linear's), from the trace; None
    where the estimate counts them itself (eager without Float8: autocast's cached bf16 casts)."""
    if not (setting.compile or setting.float8 is not None):
        return None
    first = _first_of_kind(shape, layer)
    if setting.compile and (compiled := _compiled(shape, layer, mode, setting)) is not None:
        return compiled.weights
    if setting.float8 is None:
        return None
    return eager_block_saved(shape.args, first, "none", setting.kind, setting.float8).weights


@dataclass(frozen=True)
class CompiledLoss:
    """The compiled cross-entropy (meshloom.parallel.compile.build_loss_fn) at the end of the last stage."""

    # Bytes per token it saves besides its input logits (the partitioner's choice: the log-sum-exp, not the
    # log-softmax the eager loss keeps).
    saved_per_token: float
    # Whether it keeps its input logits for backward.
    keeps_logits: bool
    # Vocabulary-wide tensors its backward makes: the logits' gradient, in one fused kernel.
    vocab_wide_grads: int


def compiled_loss(
    shape: ShapeModel, layout: Layout, loss_parallel: bool, setting: TracedSetting, precision: Precision
) -> CompiledLoss | None:
    """The compiled loss's terms, or None where the loss runs eagerly (no compile, loss parallel's sharded
    cross-entropy, which build_loss_fn leaves eager, or a framework that compiles the blocks only)."""
    if not setting.compile or not precision.compiled_loss or (layout.tp > 1 and loss_parallel):
        return None
    saved = compiled_loss_saved(shape.vocab_size, setting.tokens)
    return CompiledLoss(saved.per_token, saved.keeps_input, saved.grads)
