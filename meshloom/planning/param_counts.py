"""How many elements of a model's parameters one rank stores under a layout: tensor parallel's shard, the expert
split and FSDP's dim-0 chunk, as torch.chunk cuts them (what FSDP2 and DTensor do)."""

from __future__ import annotations

import functools
import math

from meshloom.models.shape import ParamShape
from meshloom.planning.layout import Layout


def largest_chunk(size: int, parts: int) -> int:
    """The largest piece of `size` cut into `parts` by torch.chunk."""
    return math.ceil(size / parts)


def local_numel(shapes: list[ParamShape] | tuple[ParamShape, ...], layout: Layout, fsdp: int | None = None) -> int:
    """Elements one rank stores: the TP shard (expert stacks: this rank's experts), then FSDP's dim-0 chunk of it.

    fsdp: the FSDP degree of dense parameters (1 = gathered); expert stacks are sharded over fsdp / ep.
    """
    return _local_numel(tuple(shapes), layout.tp, layout.ep, layout.fsdp if fsdp is None else fsdp)


# The planner estimates thousands of layouts of one model whose blocks mostly share their shapes.
@functools.lru_cache(maxsize=65536)
def _local_numel(shapes: tuple[ParamShape, ...], tp: int, ep: int, fsdp: int) -> int:
    total = 0
    for param in shapes:
        local = list(param.shape)
        if param.expert:
            local[0] = largest_chunk(local[0], ep)
            shard = max(1, fsdp // ep) if fsdp > 1 else 1
        else:
            if param.tp_dim is not None and tp > 1:
                local[param.tp_dim] = largest_chunk(local[param.tp_dim], tp)
            shard = fsdp
        local[0] = largest_chunk(local[0], shard)
        total += math.prod(local)
    return total


def in_fsdp(params: tuple[ParamShape, ...], experts_out: bool) -> tuple[ParamShape, ...]:
    """The parameters FSDP units manage: all, or all but the routed experts (`experts_out`)."""
    return tuple(p for p in params if not p.expert) if experts_out else params
