"""Tensor-parallel plans of the shared layers (GQA attention, SwiGLU MLP), by their module names in a block.

Heads and hidden units are split: q/k/v and w1/w3 by column, wo and w2 by row, back to sequence shards. The
sequence-sharded block input is gathered whole on the way into attention and the MLP (cos/sin stay local tensors).
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel, SequenceParallel


def attention_plan(**extra: ParallelStyle) -> dict[str, ParallelStyle]:
    """The block's attention and both norms; `extra` adds entries for modules between the projections (QK-norm)."""
    return {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        **extra,
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
    }


def dense_mlp_plan(prefix: str = "feed_forward") -> dict[str, ParallelStyle]:
    return {
        prefix: PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        f"{prefix}.w1": ColwiseParallel(),
        f"{prefix}.w3": ColwiseParallel(),
        f"{prefix}.w2": RowwiseParallel(output_layouts=Shard(1)),
    }
