"""The shape model's per-block and per-end figures the memory estimate reads, cached: the planner asks for the same
blocks' bytes for thousands of layouts, and equal blocks are one object so that each kind is counted once."""

from __future__ import annotations

import functools

from meshloom.models.shape import ParamShape, ShapeModel
from meshloom.planning.pipeline_stages import StageShape

# The planner asks for the same blocks' bytes for thousands of layouts.
_block_activation = functools.lru_cache(maxsize=65536)(
    lambda shape, layer, mode, tp, a: shape.block_activation_bytes_per_token(layer, mode, tp, a)
)
_recompute_peak = functools.lru_cache(maxsize=65536)(
    lambda shape, layer, mode, tp, a, ep: shape.block_recompute_bytes_per_token(layer, mode, tp, a, ep)
)

_attention_backward = functools.lru_cache(maxsize=65536)(
    lambda shape, layer, mode, tp, a: shape.block_attention_backward_bytes_per_token(layer, mode, tp, a)
)
_mixer_recompute = functools.lru_cache(maxsize=65536)(
    lambda shape, layer, mode, tp, a: shape.block_mixer_recompute_bytes_per_token(layer, mode, tp, a)
)

_BLOCK_KINDS: dict[tuple[ParamShape, ...], tuple[ParamShape, ...]] = {}


@functools.lru_cache(maxsize=4096)
def cached_block_params(shape: ShapeModel, layer: int) -> tuple[ParamShape, ...]:
    """A block's parameters, kept (a shape model is fixed once built), and the same object for equal blocks."""
    params = tuple(shape.block_params(layer))
    return _BLOCK_KINDS.setdefault(params, params)


@functools.lru_cache(maxsize=4096)
def cached_mlp_params(shape: ShapeModel, layer: int) -> tuple[ParamShape, ...]:
    """A block's MLP parameters (`ShapeModel.block_mlp_params`), kept like the block's."""
    return tuple(shape.block_mlp_params(layer))


@functools.lru_cache(maxsize=256)
def describes_mlp(shape: ShapeModel) -> bool:
    """Whether the family gives its blocks' MLP parameters (`ShapeModel.block_mlp_params`)."""
    return any(cached_mlp_params(shape, layer) for layer in range(shape.n_layers))


@functools.lru_cache(maxsize=256)
def cached_root_params(shape: ShapeModel, first: bool, last: bool) -> tuple[ParamShape, ...]:
    """The embedding, output and whatever else the family keeps at the ends of a stage, kept like the blocks'."""
    return tuple(shape.root_params(first, last))


def rank_root_params(shape: ShapeModel, stage: StageShape) -> tuple[ParamShape, ...]:
    """The ends a pipeline rank holds. A V schedule's rank 0 holds the first and the last stage as two model parts,
    each built with its own ends (the last one's copy of the embedding included, where the family keeps one)."""
    if stage.first and stage.last and len(stage.stages) > 1:
        return cached_root_params(shape, True, False) + cached_root_params(shape, False, True)
    return cached_root_params(shape, stage.first, stage.last)


@functools.lru_cache(maxsize=64)
def _with_math_attention(shape: ShapeModel, seq_len: int) -> ShapeModel:
    return shape.with_math_attention(seq_len)


@functools.lru_cache(maxsize=64)
def _with_context_parallel(shape: ShapeModel, cp: int, seq_len: int) -> ShapeModel:
    return shape.with_context_parallel(cp, seq_len)


@functools.lru_cache(maxsize=4096)
def is_moe_block(shape: ShapeModel, layer: int) -> bool:
    return any(p.expert for p in cached_block_params(shape, layer))
