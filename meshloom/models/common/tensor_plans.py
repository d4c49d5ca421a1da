"""Tensor-parallel plans of the shared layers (GQA attention, SwiGLU MLP), by their module names in a block.

Heads and hidden units are split: q/k/v and w1/w3 by column, wo and w2 by row, back to sequence shards. The
sequence-sharded block input is gathered whole on the way into attention and the MLP (cos/sin stay local tensors).
Per-head parameters that no projection holds (attention sinks, a recurrent layer's decay rates and convolution
filters) go with their heads through `ShardHeads`.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
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


class ShardHeads(ParallelStyle):
    """The module's parameters `names`, laid out head by head along dim 0, become DTensors sharded on dim 0 over tp,
    so each rank holds the values of its own heads; the module reads them with `local_tensor`."""

    def __init__(self, *names: str):
        super().__init__()
        self.names = names

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        for name in self.names:
            param = getattr(module, name)
            sharded = distribute_tensor(param.data, device_mesh, [Shard(0)], src_data_rank=None)
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        return module
