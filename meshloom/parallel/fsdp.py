"""FSDP2: shard every transformer block, then the root (embedding, final norm, output)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard


def apply_fsdp(
    model: nn.Module,
    blocks: list[nn.Module],
    mesh: DeviceMesh,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: str,
    cpu_offload: bool,
) -> None:
    """`mesh` is 1-D for FSDP or 2-D (replicate, shard) for HSDP; FSDP2 picks the mode from its shape."""
    common = dict(
        mesh=mesh,
        mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
        offload_policy=CPUOffloadPolicy(pin_memory=False) if cpu_offload else OffloadPolicy(),
    )
    for index, block in enumerate(blocks):
        if reshard_after_forward == "default":
            # Backward starts with the last block, so freeing its gathered weights would only re-gather them.
            reshard = index < len(blocks) - 1
        else:
            reshard = reshard_after_forward == "always"
        fully_shard(block, reshard_after_forward=reshard, **common)
    # The root's parameters (embedding, norm, output) are needed first in backward: keep them gathered.
    fully_shard(model, reshard_after_forward=reshard_after_forward == "always", **common)
